"""The open-file limit of a process that peers connect to: each connection is a
file, and a process past its limit fails wherever it next opens one.

The soft limit is often 1,024 while the hard one allows far more (systemd's
default is 524,288): each process raises its soft limit to the hard one at
start, as Go's runtime does for every program.
"""

from __future__ import annotations

import resource

# Where the hard limit is unlimited, Linux still refuses a soft limit past
# fs.nr_open (1,048,576 by default).
_UNLIMITED_SOFT_LIMIT = 1 << 20


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, where it
    may; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _UNLIMITED_SOFT_LIMIT if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            return soft  # a sandbox that allows no change
        return wanted
    return soft
