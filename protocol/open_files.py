"""The open-file limit of a process that peers connect to: each connection is a
file, and a process past its limit fails wherever it next opens one.

The soft limit is often 1,024 while the hard one allows far more (systemd's
default is 524,288): each process raises its soft limit to the hard one at
start, as Go's runtime does for every program.
"""

from __future__ import annotations

import resource

# What stands for an unlimited hard limit: Linux refuses a soft limit past
# fs.nr_open (1,048,576 by default), macOS past OPEN_MAX (10,240).
_UNLIMITED = (1 << 20, 10240)


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, where it
    may; the soft limit now (unlimited read as a million)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _UNLIMITED[0]
    wanted = _UNLIMITED if hard == resource.RLIM_INFINITY else (hard,)
    for limit in wanted:
        if limit <= soft:
            return soft
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        except (ValueError, OSError):
            continue  # past what the system allows, or a sandbox that allows no change
        return limit
    return soft
