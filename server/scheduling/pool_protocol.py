"""What the scheduling layer needs of the worker pool, and the scheduler's knobs from the config.

The pool itself is server/pool/pool.py; the unit tests drive the scheduler with a fake one
(tests/support/fakes.py). Every method is called from the scheduler's thread, or under its lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from loaderd.server.config.schema import LoaderConfig
from loaderd.server.pool.pool import PoolEvent
from loaderd.server.worker.tasks import Task


class Pool(Protocol):
    """The worker pool as the scheduler drives it."""

    @property
    def size(self) -> int: ...

    def is_ready(self, worker_id: int) -> bool: ...

    def submit(self, worker_id: int, task: Task) -> None:
        """Send ``task`` to the worker (never blocks); ValueError or OSError if its pipe is closed (it died)."""
        ...

    def poll(self, timeout: float, extra: Sequence[Any] = ()) -> list[PoolEvent]:
        """Results and deaths within ``timeout`` (returning early when any of ``extra`` is readable)."""
        ...

    def respawn(self, worker_id: int) -> None:
        """Start a worker in a slot that has none running: a dead worker's replacement, or a parked slot of an
        elastic pool joining it; OSError if it cannot now (e.g. out of file descriptors), PoolLostError if it
        never can (the scheduler then stops the daemon)."""
        ...

    def remove(self, worker_id: int) -> None:
        """Forget the slot's dead worker: it left an elastic pool (no longer listed; ``respawn`` may start it again)."""
        ...

    def cpu_seconds(self, worker_id: int) -> float | None:
        """CPU seconds the slot's worker process has used (None: no worker there, or unknown)."""
        ...

    def private_bytes(self, worker_id: int) -> int | None:
        """Memory only the slot's worker maps (what another worker would add; None: no worker there, or unknown)."""
        ...

    def stop_worker(self, worker_id: int, kill: bool) -> int:
        """End a live worker (SIGKILL, or after its queued tasks with ``kill=False``); returns its generation.

        It is not ready from this call on; its death then comes through ``poll`` like any other.
        """
        ...

    def rss_bytes(self, worker_id: int) -> int:
        """The worker's resident memory (0 if unknown)."""
        ...


@dataclass(frozen=True)
class SchedulerPolicy:
    """The scheduler's knobs, from the config."""

    share_buffer: int = 32
    # dataset -> seconds a batch may run before its worker is killed (absent: no limit).
    task_timeouts: Mapping[str, float] = field(default_factory=dict)
    max_tasks_per_worker: int = 0  # 0: never recycle by count
    worker_max_rss_bytes: int = 0  # 0: never recycle by memory
    # Seconds a replacement worker may take to build its datasets before it is killed (a failed
    # start): the daemon's --startup-timeout, which bounds the pool's first start the same way.
    start_timeout: float = 600.0
    # An elastic pool's fewest workers (it starts with these, and sizes itself up to the pool's slots); None: fixed.
    min_workers: int | None = None

    @classmethod
    def from_config(cls, config: LoaderConfig, start_timeout: float = 600.0) -> SchedulerPolicy:
        return cls(
            share_buffer=config.share_buffer,
            task_timeouts={n: d.task_timeout for n, d in config.datasets.items() if d.task_timeout is not None},
            max_tasks_per_worker=config.max_tasks_per_worker,
            worker_max_rss_bytes=config.worker_max_rss_mb << 20,
            start_timeout=start_timeout,
            min_workers=config.min_workers,
        )
