"""What a set of processes costs: CPU seconds and proportional memory (PSS), read from /proc.

Linux only. A process that exited meanwhile counts nothing; ``pss_bytes`` is None when a live process's
memory cannot be read (another user's, without the privilege; a kernel without ``smaps_rollup``).
PSS (proportional set size) splits each shared page among the processes that map it, so the
PSS of a set adds up without counting a fork's copy-on-write pages or a shared-memory batch
twice. Used by ``loaderd bench`` (server/app/bench.py); the daemon itself never reads it.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from collections.abc import Iterable
from pathlib import Path

_PROC = Path("/proc")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command (which may hold spaces and parentheses); None if gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def children_by_parent() -> dict[int, list[int]]:
    """Every process's children, by parent pid (one pass over /proc)."""
    tree: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def descendants(pid: int, tree: dict[int, list[int]] | None = None) -> list[int]:
    """``pid``'s children, their children, and so on (not ``pid`` itself)."""
    tree = children_by_parent() if tree is None else tree
    found: list[int] = []
    todo = list(tree.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(tree.get(child, []))
    return found


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds the processes have used so far (each its own threads, not its children)."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
    return total * _TICK_S


def pss_bytes(pids: Iterable[int]) -> int | None:
    """The processes' summed PSS now (those that exited meanwhile count nothing); None if the memory of one
    still there cannot be read: a partial sum would pass for the whole."""
    total = 0
    for pid in pids:
        folder = _PROC / str(pid)
        try:
            text = (folder / "smaps_rollup").read_text()
        except ProcessLookupError:
            continue  # exited, not yet reaped (ESRCH)
        except OSError:
            if folder.exists():
                return None
            continue  # exited
        for line in text.splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1]) * 1024
                break
    return total


def unix_peer_pid(path: str, timeout_s: float = 2.0) -> int | None:
    """The pid of the process listening on unix socket ``path`` (its credentials, SO_PEERCRED); None if unknown."""
    if not sys.platform.startswith("linux"):  # SO_PEERCRED and its struct ucred are Linux's
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        except OSError:
            return None
    return pid or None
