"""How much memory this process's host, or its cgroup, has available (Linux: /proc, cgroup v2 or v1).

Inside a container the host's ``MemAvailable`` overstates what the daemon may use: the cgroup's
limit less its usage (v2 ``memory.max - memory.current``, v1 ``memory.limit_in_bytes -
memory.usage_in_bytes``) is the truth there, so the smaller of the two counts.
"""

from __future__ import annotations

import os
from pathlib import Path

_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/proc/self/cgroup")
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1_UNLIMITED = 1 << 60  # v1 says "no limit" with a huge page-rounded number


def _meminfo(key: str = "MemAvailable:") -> int | None:
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available(limit_only: bool = False) -> int | None:
    """``memory.max - memory.current`` of this process's cgroup v2 (the tightest of it and its parents; with
    ``limit_only``, ``memory.max``); None if unlimited."""
    try:
        lines = _CGROUP.read_text().splitlines()
    except OSError:
        return None
    own = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
    if own is None:
        return None
    tightest: int | None = None
    group = _CGROUP_ROOT / own.lstrip("/")
    while True:
        try:
            limit = (group / "memory.max").read_text().strip()
            if limit != "max":
                room = int(limit) if limit_only else max(0, int(limit) - int((group / "memory.current").read_text()))
                tightest = room if tightest is None else min(tightest, room)
        except (OSError, ValueError):
            pass
        if group == _CGROUP_ROOT or group.parent == group:
            return tightest
        group = group.parent


def _cgroup_v1_available(limit_only: bool = False) -> int | None:
    """v1's memory controller: this process's group as mounted (a container sees its own at the root), its limit less
    its usage (with ``limit_only``, its limit); None if unlimited."""
    try:
        lines = _CGROUP.read_text().splitlines()
    except OSError:
        return None
    own = next((line.split(":", 2)[2] for line in lines if line.split(":", 2)[1:2] == ["memory"]), None)
    if own is None:
        return None
    for group in (_CGROUP_ROOT / "memory" / own.lstrip("/"), _CGROUP_ROOT / "memory"):
        try:
            limit = int((group / "memory.limit_in_bytes").read_text())
            usage = int((group / "memory.usage_in_bytes").read_text())
        except (OSError, ValueError):
            continue
        if limit >= _V1_UNLIMITED:
            return None
        return limit if limit_only else max(0, limit - usage)
    return None


def available_bytes() -> int | None:
    """The memory this process could still use: the host's MemAvailable, or its cgroup's room if smaller; None if unknown."""
    known = [n for n in (_meminfo(), _cgroup_available(), _cgroup_v1_available()) if n is not None]
    return min(known) if known else None


def limit_bytes() -> int | None:
    """The most memory this process's host, or its cgroup if smaller, holds (MemTotal, ``memory.max``); None if unknown."""
    known = [n for n in (_meminfo("MemTotal:"), _cgroup_available(True), _cgroup_v1_available(True)) if n is not None]
    return min(known) if known else None


def free_bytes(directory: str) -> int | None:
    """Bytes free for an unprivileged writer in ``directory``'s file system (/dev/shm: its tmpfs' room); None if unknown."""
    try:
        stat = os.statvfs(directory)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize
