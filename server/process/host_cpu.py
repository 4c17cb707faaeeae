"""How many CPUs this process may use, and how many sat idle lately (Linux: affinity, /proc/stat, cgroup v2 or v1).

Inside a container ``os.cpu_count()`` counts the host's CPUs; what the daemon may really use is the
CPUs its affinity allows, capped by its cgroup's quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``; the tightest of the group and its parents). ``CpuRoom`` measures what of that
went unused between two looks: the idle time of the CPUs it may run on, and the quota less the
group's use (v2 ``cpu.stat`` ``usage_usec``, v1 ``cpuacct.usage``), whichever is smaller.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

_STAT = Path("/proc/stat")
_CGROUP = Path("/proc/self/cgroup")
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_TICK = os.sysconf("SC_CLK_TCK")


def _own_groups() -> tuple[str | None, dict[str, str]]:
    """This process's cgroup v2 path (None: no v2) and its v1 paths by controller."""
    try:
        lines = _CGROUP.read_text().splitlines()
    except OSError:
        return None, {}
    v2, v1 = None, {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if not controllers:
            v2 = path
        for controller in controllers.split(","):
            if controller:
                v1[controller] = path
    return v2, v1


def _v2_groups(path: str) -> list[Path]:
    """The v2 group at ``path`` and its parents up to the root."""
    group = _CGROUP_ROOT / path.lstrip("/")
    groups = [group]
    while group != _CGROUP_ROOT and group.parent != group:
        group = group.parent
        groups.append(group)
    return groups


def cpu_quota() -> float | None:
    """The CPUs this process's cgroup may use (its quota over its period; the tightest along its path); None if unlimited."""
    v2, v1 = _own_groups()
    quotas: list[float] = []
    for group in _v2_groups(v2) if v2 is not None else []:
        try:
            quota, period = (group / "cpu.max").read_text().split()
            if quota != "max":
                quotas.append(int(quota) / int(period))
        except (OSError, ValueError):
            continue
    own = v1.get("cpu")
    if own is not None:
        for group in (_CGROUP_ROOT / "cpu" / own.lstrip("/"), _CGROUP_ROOT / "cpu"):  # a container sees its own at the root
            try:
                quota_us = int((group / "cpu.cfs_quota_us").read_text())
                period_us = int((group / "cpu.cfs_period_us").read_text())
            except (OSError, ValueError):
                continue
            if quota_us > 0 and period_us > 0:
                quotas.append(quota_us / period_us)
            break
    return min(quotas) if quotas else None


def usable_cpus() -> int:
    """The CPUs this process may keep busy: its affinity's, capped by its cgroup's quota (rounded down; at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except OSError:
        cpus = os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)


def _idle_seconds(cpus: frozenset[int]) -> float | None:
    """Seconds ``cpus`` have spent idle (idle + iowait) since boot; None if /proc/stat cannot be read."""
    try:
        lines = _STAT.read_text().splitlines()
    except OSError:
        return None
    idle = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            idle += int(fields[3]) + int(fields[4])
    return idle / _TICK


def _group_usage_seconds() -> float | None:
    """CPU seconds this process's cgroup has used (v2 ``usage_usec``, v1 ``cpuacct.usage``); None if unknown."""
    v2, v1 = _own_groups()
    if v2 is not None:
        try:
            for line in (_CGROUP_ROOT / v2.lstrip("/") / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
        except (OSError, ValueError):
            pass
    own = v1.get("cpuacct")
    if own is not None:
        for group in (_CGROUP_ROOT / "cpuacct" / own.lstrip("/"), _CGROUP_ROOT / "cpuacct"):
            try:
                return int((group / "cpuacct.usage").read_text()) / 1e9
            except (OSError, ValueError):
                continue
    return None


class CpuRoom:
    """CPUs left idle between two looks (``idle()``), as far as this process may use them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        try:
            self._cpus = frozenset(os.sched_getaffinity(0))
        except OSError:
            self._cpus = frozenset(range(os.cpu_count() or 1))
        self._quota = cpu_quota()
        self._last = self._read()

    def _read(self) -> tuple[float, float | None, float | None]:
        return self._clock(), _idle_seconds(self._cpus), _group_usage_seconds() if self._quota is not None else None

    def idle(self) -> float | None:
        """The CPUs that sat idle on average since the last call (or construction); None if unknown."""
        now = self._read()
        (then, idle_then, used_then), self._last = self._last, now
        seconds = now[0] - then
        if seconds <= 0:
            return None
        room: list[float] = []
        if now[1] is not None and idle_then is not None:
            room.append(max(0.0, (now[1] - idle_then) / seconds))
        if self._quota is not None and now[2] is not None and used_then is not None:
            room.append(max(0.0, self._quota - (now[2] - used_then) / seconds))
        return min(room) if room else None


def process_cpu_seconds(pid: int) -> float | None:
    """The CPU seconds (user + system) process ``pid`` has used; None if it cannot be read (gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()  # the name may hold spaces and parentheses
    try:
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (IndexError, ValueError):
        return None


def process_private_bytes(pid: int) -> int | None:
    """Memory only process ``pid`` maps (Private_Clean + Private_Dirty, from smaps_rollup); None if unknown.

    What a forked worker costs beyond the pages it shares with its fork server: the figure a new one
    would add (RSS counts the shared pages of every worker again)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
            lines = rollup.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
            total += int(line.split()[1]) * 1024
    return total
