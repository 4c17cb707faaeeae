"""ElasticPool: measures an elastic pool once a period, asks its ``PoolSizer`` for a size, and has the supervisor apply it.

The figures come from their owners: the dispatcher's clocks and the scheduler's batch counts
(``SchedulerClocks``, read under the scheduler's lock), the workers' CPU time and private memory
from the pool (/proc), the idle CPU from ``CpuRoom`` and the memory left from host_memory. Each
change is one log line with its reason; ``view`` is what status and the metrics show.

Runs on the scheduler's thread (``tick`` once a round; it acts once per ``PERIOD_S``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from loaderd.server.process.host_cpu import CpuRoom
from loaderd.server.process.host_memory import available_bytes, limit_bytes
from loaderd.server.scheduling.pool_protocol import Pool
from loaderd.server.scheduling.sizing import PERIOD_S, PoolLoad, PoolSizer, PoolView
from loaderd.server.scheduling.supervision import WorkerSupervisor

log = logging.getLogger("loaderd.scheduler")

# The workers' private memory is read (smaps_rollup: ~1 ms a worker) at most this often.
MEMORY_EVERY_S = 10.0


@dataclass(frozen=True)
class SchedulerHooks:
    """What the sizing asks of the scheduler that owns it."""

    clocks: Callable[[], SchedulerClocks]  # its counts (takes its lock)
    idle: Callable[[int], bool]  # whether a worker holds no task (asked under its lock)
    pinned: Callable[[int], int]  # iterable replicas placed in a worker slot (asked under its lock)
    resized: Callable[[int], None]  # told each new size (it fits its streams' windows to it; takes its lock)


@dataclass(frozen=True)
class SchedulerClocks:
    """What the scheduler counted since it started, read under its lock."""

    busy_s: float  # worker-seconds spent holding a task
    starved_s: float  # seconds tasks waited with every ready worker full
    batches: int  # batches the pool finished
    clients: int  # training processes with an open stream


class ElasticPool:
    """Sizes an elastic pool (see server/scheduling/sizing.py for the rules)."""

    def __init__(
        self,
        sizer: PoolSizer,
        supervisor: WorkerSupervisor,
        pool: Pool,
        scheduler: SchedulerHooks,
        cpu: CpuRoom | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sizer = sizer
        self._supervisor = supervisor
        self._pool = pool
        self._scheduler = scheduler
        self._cpu = cpu or CpuRoom()
        self._clock = clock
        self._then = clock()
        self._last = scheduler.clocks()
        self._worker_cpu: dict[int, float] = {}
        self._worker_bytes = 0
        self._memory_at = float("-inf")
        self._held = ""
        self._stopped = False
        self._limited_s = 0.0
        self._view = sizer.view()  # replaced whole (status reads it from other threads)

    def view(self) -> PoolView:
        return self._view

    def tick(self) -> None:
        """Once a round: every ``PERIOD_S``, measure, decide and apply. Never raises: a failure stops the sizing
        (logged, and shown in status), the pool keeps its size, and the scheduler's round goes on."""
        if self._stopped:
            return
        try:
            self._tick()
        except Exception as exc:  # the scheduler's round (replacements, timeouts) must go on
            log.exception("pool: sizing failed; the pool keeps its %d workers from now on", len(self._supervisor.members()))
            self._stopped = True
            self._view = dataclasses.replace(self._view, held=f"sizing stopped: {type(exc).__name__}: {exc} (see the log)")

    def _tick(self) -> None:
        now = self._clock()
        if now - self._then < PERIOD_S:
            return
        self._reconcile()
        load = self._measure(now)
        log.debug("pool load: %s", load)
        resize = self._sizer.decide(load)
        if resize is not None:
            log.info("pool: %s", resize.reason)
            self._supervisor.resize(resize.target, self._scheduler.idle, self._scheduler.pinned)
            self._scheduler.resized(resize.target)
        held = self._sizer.held
        if held and held.split(" (")[0] != self._held.split(" (")[0]:  # once per cause, not per figure
            log.info("pool: not growing though tasks wait for a worker: %s", held)
        self._held = held
        if resize is None and self._sizer.at_limit():
            self._limited_s += load.starved * load.seconds
        self._view = self._sizer.view(self._limited_s)

    def _reconcile(self) -> None:
        """A member given up (its starts kept failing) leaves the pool short of its target: the target comes down to
        what the pool has, and its most to what it may still have (a slot given up never comes back)."""
        members = len(self._supervisor.members())
        most = members + len(self._supervisor.parked()) + len(self._supervisor.slots.leaving)
        if members < self._sizer.target or most < self._sizer.most:
            self._sizer.lost_workers(members, most)
            self._scheduler.resized(self._sizer.target)

    def _measure(self, now: float) -> PoolLoad:
        clocks, last = self._scheduler.clocks(), self._last
        seconds = max(1e-9, now - self._then)
        self._then, self._last = now, clocks
        members = self._supervisor.members()
        serving = set(self._supervisor.accepting()) & set(members)
        # Workers still leaving count: the last change is done once they are gone (their slots parked again).
        settling = len(self._supervisor.slots.leaving)
        worker_cpu = self._cpu_used(members) / seconds
        if now - self._memory_at >= MEMORY_EVERY_S:
            self._memory_at = now
            self._worker_bytes = max((self._pool.private_bytes(w) or 0 for w in members), default=0)
        return PoolLoad(
            at=now,
            seconds=seconds,
            members=len(members) + settling,
            serving=len(serving),
            busy=(clocks.busy_s - last.busy_s) / seconds,
            starved=min(1.0, (clocks.starved_s - last.starved_s) / seconds),
            batches=clocks.batches - last.batches,
            worker_cpu=worker_cpu,
            idle_cpu=self._cpu.idle(),
            memory_room=available_bytes(),
            memory_limit=limit_bytes(),
            worker_bytes=self._worker_bytes,
            clients=clocks.clients,
        )

    def _cpu_used(self, members: list[int]) -> float:
        """CPU seconds the members' workers used since the last look (a new process counts from its start)."""
        used = 0.0
        seen: dict[int, float] = {}
        for worker_id in members:
            total = self._pool.cpu_seconds(worker_id)
            if total is None:
                continue
            before = self._worker_cpu.get(worker_id, 0.0)
            used += total - before if total >= before else total
            seen[worker_id] = total
        self._worker_cpu = seen
        return used
