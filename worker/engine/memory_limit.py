"""How much memory this process may use: the host's RAM, or less where a cgroup
limits it (a container's ``--memory``, Kubernetes' ``limits.memory``, systemd's
``MemoryMax``). Past it the kernel's OOM killer ends the process, with no message
the process could write first. And how much it holds already."""

from __future__ import annotations

from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")


def memory_limit_bytes(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT
) -> tuple[int, str]:
    """The bytes this process may use, and what says so ("the host's memory", or
    "its cgroup's memory.max")."""
    limit = psutil.virtual_memory().total, "the host's memory"
    for directory, file_name in _memory_cgroups(proc_cgroup, root):
        # The cgroup and each above it limit it; where a cgroup namespace hides the
        # path (a container), the container's own limits are at the mount's root.
        for folder in [directory, *directory.parents]:
            if not folder.is_relative_to(root):
                break
            value = _read_limit(folder / file_name)
            if value is not None and value < limit[0]:
                limit = value, f"its cgroup's {file_name}"
    return limit


def _memory_cgroups(proc_cgroup: Path, root: Path) -> list[tuple[Path, str]]:
    """This process's memory cgroup directories, with the file naming their limit:
    cgroup v2's memory.max (the unified line "0::/path"), v1's memory.limit_in_bytes."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":
            found.append((root / relative, "memory.max"))
        elif "memory" in controllers.split(","):
            found.append((root / "memory" / relative, "memory.limit_in_bytes"))
    return found


def _read_limit(path: Path) -> int | None:
    """The limit in ``path``; None where there is none or it is "max" (cgroup
    v1 writes a number near 2^63 instead, larger than any host's memory)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def resident_bytes() -> int:
    """This process's resident set. Looked up at each call: a worker forked from the
    fork server is not the process that imported this module."""
    return int(psutil.Process().memory_info().rss)
