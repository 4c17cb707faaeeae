"""UsageMeter: what one loader's processes cost over an epoch of ``loaderd bench`` (CPU seconds, peak PSS).

Read from /proc by server/process/process_usage.py; ``loader_meters`` names each loader's processes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from loaderd.server.process.process_usage import children_by_parent, cpu_seconds, descendants, pss_bytes


class UsageMeter:
    """CPU seconds and peak PSS of one loader's processes over an epoch.

    ``processes`` names them anew at each look (a pool may replace a worker mid-epoch; one that exits
    within the epoch takes its CPU since ``begin`` with it). PSS is read at the first batch, then at
    most every ``SAMPLE_EVERY_S`` while batches arrive, and once at the end; the CPU this thread
    spends reading /proc is left out of the figure.
    """

    SAMPLE_EVERY_S = 0.5

    def __init__(self, processes: Callable[[], list[int]]) -> None:
        self._processes = processes
        self._cpu_at_start: dict[int, float] = {}
        self._own_s = 0.0  # this process's CPU spent reading /proc
        self._peak: int | None = None
        self._next_look = 0.0

    def begin(self) -> None:
        started = time.thread_time()
        self._cpu_at_start = {pid: cpu_seconds([pid]) for pid in self._processes()}
        self._peak, self._next_look = None, time.monotonic() + self.SAMPLE_EVERY_S
        self._own_s = time.thread_time() - started

    def look(self, force: bool = False) -> None:
        """Read the processes' PSS if it is time to (``force``: now)."""
        if not force and time.monotonic() < self._next_look:
            return
        started = time.thread_time()
        pss = pss_bytes(self._processes())
        if pss is not None:
            self._peak = pss if self._peak is None else max(self._peak, pss)
        self._next_look = time.monotonic() + self.SAMPLE_EVERY_S
        self._own_s += time.thread_time() - started

    def end(self) -> tuple[float, int | None]:
        """CPU seconds the processes used since ``begin`` (less the meter's own), and their peak PSS."""
        self.look(force=True)
        started = time.thread_time()
        used = sum(cpu_seconds([pid]) - self._cpu_at_start.get(pid, 0.0) for pid in self._processes())
        self._own_s += time.thread_time() - started
        return max(0.0, used - self._own_s), self._peak


def loader_meters(daemon_pid: int | None) -> dict[str, UsageMeter]:
    """Each loader's processes: this one (the training loop) and torch's workers, or the daemon and its pool."""
    me = os.getpid()

    def daemon_tree(tree: dict[int, list[int]]) -> list[int]:
        return [] if daemon_pid is None else [daemon_pid, *descendants(daemon_pid, tree)]

    def torch_processes() -> list[int]:
        tree = children_by_parent()
        theirs = set(daemon_tree(tree))
        return [me, *(pid for pid in descendants(me, tree) if pid not in theirs)]

    def loaderd_processes() -> list[int]:
        return [me, *daemon_tree(children_by_parent())]

    loaderd = UsageMeter(loaderd_processes)
    return {"torch": UsageMeter(torch_processes), "shm": loaderd, "grpc": loaderd}
