"""PoolSizer: how many workers an elastic pool (``workers: auto`` or ``{min, max}``) should have, from what it saw.

Once a second (``PERIOD_S``) the scheduler hands the sizer a ``PoolLoad``: how busy the workers were,
how long tasks waited with every worker full (the pool, not the trainers, held the data back), the
batches made, the CPU the workers used and what was left idle, and the memory left. Its rules:

- **Grow** when tasks waited for a worker at least ``GROW_STARVED`` of the period and the workers were at
  least ``GROW_BUSY`` busy, unless the CPUs this process may use have no room for another worker (idle CPU
  below half of what a busy worker uses: a CPU-bound dataset gains nothing past its cores, an I/O-bound one
  grows past them) or memory would run short (the host's or cgroup's room less the new workers' private
  memory must stay above ``MEMORY_RESERVE`` of its limit). One worker at a time, doubling the step while each
  growth paid near-linearly (a pool far too small gets there in a few steps).
- **Check that a growth paid** (Cachew's hill-climbing, ATC'22): once the new workers are ready and have
  settled (``SETTLE_S``), the batches per second over ``MEASURE_S`` (and ``MEASURE_BATCHES`` at least) must
  beat the rate before by ``PAYS`` (7%); otherwise the pool goes back, and that size is not tried again for
  ``HOLD_S`` (doubling while it keeps not paying), unless the load changes (clients come or go). A gain of
  half the ideal (throughput in proportion to the workers) or more is taken at once, without the whole window.
- **Shrink** when tasks hardly waited (under ``SHRINK_STARVED``) and the smaller pool would have been at most
  ``SHRINK_BUSY`` busy, for ``SHRINK_AFTER_S`` running: to the fewest workers that would (idle trainers: to
  ``min`` in one step, so memory comes back within seconds).
- The gaps are the hysteresis: growth needs the pool full and tasks waiting; shrinking needs no task waiting
  and 30% headroom after. A change waits until the last one's workers are ready or gone.

Pure: no clock or process of its own; unit tests drive it with made-up loads (tests/unit/test_sizing.py).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

PERIOD_S = 1.0
GROW_STARVED = 0.5
GROW_BUSY = 0.8
SHRINK_STARVED = 0.3
SHRINK_BUSY = 0.7
SHRINK_AFTER_S = 3.0
SETTLE_S = 0.5
MEASURE_S = 2.0
MEASURE_BATCHES = 8
MEASURE_MAX_S = 20.0  # a growth judged on fewer batches than MEASURE_BATCHES after this long is kept
PAYS = 0.07
HOLD_S = (60.0, 600.0)
MEMORY_RESERVE = 0.1
MEMORY_RESERVE_FLOOR = 256 << 20


@dataclass(frozen=True)
class PoolLoad:
    """One period's figures (``PERIOD_S`` or so), as the scheduler measured them."""

    at: float  # when the period ended (monotonic seconds)
    seconds: float
    members: int  # workers in the pool: serving, starting, or still leaving it
    serving: int  # of them, ready and taking work
    busy: float  # workers holding a task, on average
    starved: float  # share of the period tasks waited with every ready worker full
    batches: int  # batches the pool finished
    worker_cpu: float | None = None  # CPUs the workers used, on average (None: unknown)
    idle_cpu: float | None = None  # CPUs this process may use that sat idle (None: unknown)
    memory_room: int | None = None  # bytes the host or cgroup has available now (None: unknown)
    memory_limit: int | None = None  # bytes it holds in all
    worker_bytes: int = 0  # the private memory of the biggest worker: what another one would add
    clients: int = 0  # training processes with an open stream: a change means the load changed


@dataclass(frozen=True)
class Resize:
    """The sizer's decision: this many workers, and why (one log line)."""

    target: int
    reason: str


@dataclass(frozen=True)
class PoolView:
    """An elastic pool as status shows it."""

    least: int
    most: int
    target: int
    reason: str  # why the last change (or the start)
    held: str  # why it does not grow though tasks wait ("" if it is not held)
    # Seconds tasks waited with every worker busy while the pool could not grow (at its most, or held):
    # what more daemons would relieve (an autoscaler of daemons scales on its rate).
    limited_s: float = 0.0


@dataclass
class _Trial:
    """A growth being judged: from ``before`` workers to the new size, against ``rate_before`` batches/s."""

    before: int
    rate_before: float
    ready_at: float | None = None
    seconds: float = 0.0
    batches: int = 0


class PoolSizer:
    """Decides an elastic pool's size between ``least`` and ``most`` (see the module docstring)."""

    def __init__(self, least: int, most: int) -> None:
        self.least, self.most = least, most
        self.target = least
        self.reason = f"started with its fewest workers ({least})"
        # Why the pool does not grow though tasks wait (no idle CPU, memory short, a size that did not pay); "" if not held.
        self.held = ""
        self._step = 1
        self._trial: _Trial | None = None
        self._ceiling: int | None = None  # a size that did not pay, not tried again before ``_ceiling_until``
        self._ceiling_until = 0.0
        self._hold_s = HOLD_S[0]
        self._quiet: list[PoolLoad] = []  # the periods running in which the pool could have been smaller
        self._recent: deque[PoolLoad] = deque(maxlen=3)  # the last periods at a settled size (the rate before a growth)
        self._clients: int | None = None

    def lost_workers(self, members: int, most: int) -> None:
        """Slots were given up (their starts kept failing): the pool has ``members`` and may have ``most`` at most.
        A growth being judged is dropped (kept as it is: what it measured no longer holds)."""
        self.most = max(self.least, min(self.most, most))
        if members < self.target:
            self.target = members
            self.reason = f"workers could not start: the pool has {members}"
        self._trial = None
        self._recent.clear()

    def view(self, limited_s: float = 0.0) -> PoolView:
        return PoolView(self.least, self.most, self.target, self.reason, self.held, limited_s)

    def at_limit(self) -> bool:
        """Whether the pool can grow no more now: at its most workers, or held (no idle CPU, memory, a size that did not pay)."""
        return self.target >= self.most or bool(self.held)

    def decide(self, load: PoolLoad) -> Resize | None:
        """The new size, if it should change after ``load``."""
        if load.clients != self._clients:  # new clients, or some left: a size that did not pay may pay now
            self._clients, self._ceiling, self._hold_s = load.clients, None, HOLD_S[0]
            if self._trial is not None:  # nor can a growth be judged across the change: kept
                self._trial = None
                self._recent.clear()
        if load.members != self.target or load.serving < self.target:
            self._quiet.clear()
            return None  # the last change is not done: workers still starting or leaving
        if self._trial is not None:
            verdict = self._judge(self._trial, load)
            if verdict is not None or self._trial is not None:
                return verdict
        self._recent.append(load)
        grow = self._grow(load)
        if grow is not None:
            return grow
        return self._shrink(load)

    # ------------------------------------------------------------ growing

    def _grow(self, load: PoolLoad) -> Resize | None:
        if load.starved < GROW_STARVED or load.busy < GROW_BUSY * load.serving or self.target >= self.most:
            self.held = ""
            return None
        self._quiet.clear()
        most = self.most
        if self._ceiling is not None and load.at < self._ceiling_until:
            most = min(most, self._ceiling - 1)
        step = min(self._step, most - self.target)
        if step <= 0:
            self.held = f"{self._ceiling} workers did not pay (retried after {self._ceiling_until - load.at:.0f}s, or when clients change)"
            return None
        step, self.held = self._room(load, step)
        if step <= 0:
            return None
        rate = sum(p.batches for p in self._recent) / max(1e-9, sum(p.seconds for p in self._recent))
        self._trial = _Trial(before=self.target, rate_before=rate)
        self.target += step
        self.reason = (
            f"tasks waited for a worker {load.starved:.0%} of the last {load.seconds:.0f}s with every worker busy: "
            f"growing to {self.target}"
        )
        return Resize(self.target, self.reason)

    def _room(self, load: PoolLoad, step: int) -> tuple[int, str]:
        """The workers that fit in the idle CPU and the memory left (at most ``step``), and why fewer if so."""
        if load.idle_cpu is not None and load.worker_cpu is not None and load.busy > 0:
            per_worker = load.worker_cpu / load.busy
            if per_worker > 0:
                fits = math.floor(load.idle_cpu / (per_worker / 2))
                if fits <= 0:
                    return 0, f"no idle CPU for another worker (idle {load.idle_cpu:.2f} CPUs; a busy worker uses {per_worker:.2f})"
                step = min(step, fits)
        if load.memory_room is not None and load.worker_bytes > 0:
            reserve = max(MEMORY_RESERVE_FLOOR, int((load.memory_limit or 0) * MEMORY_RESERVE))
            fits = (load.memory_room - reserve) // load.worker_bytes
            if fits <= 0:
                mib = 1 << 20
                return 0, (
                    f"memory: {load.memory_room // mib} MiB available, another worker takes ~{load.worker_bytes // mib} MiB "
                    f"and {reserve // mib} MiB stay free"
                )
            step = min(step, int(fits))
        return step, ""

    def _judge(self, trial: _Trial, load: PoolLoad) -> Resize | None:
        """Count a settled period toward the growth's verdict; undo a growth that did not pay."""
        if trial.ready_at is None:
            trial.ready_at = load.at
        if load.at - trial.ready_at < SETTLE_S:
            return None
        if load.starved <= SHRINK_STARVED:
            # Tasks no longer wait: the growth relieved them (or the trainers slowed or left): kept, and an idle
            # pool may shrink at once rather than wait for batches to judge by.
            self._trial = None
            self._recent.clear()
            return None
        trial.seconds += load.seconds
        trial.batches += load.batches
        rate = trial.batches / trial.seconds
        gain = rate / trial.rate_before - 1 if trial.rate_before > 0 else 0.0
        ideal = (self.target - trial.before) / max(1, trial.before)  # the gain if throughput scaled with the workers
        counted = trial.batches >= MEASURE_BATCHES
        # Half the ideal gain or more is no noise: it paid, and the next growth need not wait for the whole window.
        paid_early = counted and trial.rate_before > 0 and gain >= max(2 * PAYS, ideal / 2)
        enough = counted and trial.seconds >= MEASURE_S
        if not (enough or paid_early) and trial.seconds < MEASURE_MAX_S:
            return None
        self._trial = None
        self._recent.clear()
        if not (enough or paid_early) or trial.rate_before <= 0:
            return None  # too few batches to judge either way (slow batches): kept
        if gain >= PAYS:
            # Near-linear gain: the pool is far too small; double the next step.
            self._step = min(self._step * 2, self.most) if gain >= 0.7 * ideal else 1
            return None
        self._ceiling, self._ceiling_until = self.target, load.at + self._hold_s
        self._hold_s = min(self._hold_s * 2, HOLD_S[1])
        self._step = 1
        size = self.target
        self.target = trial.before
        self.reason = (
            f"{size} workers made {rate:.1f} batches/s, {gain:+.0%} on {trial.before} ({trial.rate_before:.1f}/s; "
            f"a growth must gain {PAYS:.0%}): back to {self.target}"
        )
        return Resize(self.target, self.reason)

    # ------------------------------------------------------------ shrinking

    def _shrink(self, load: PoolLoad) -> Resize | None:
        if self.target <= self.least or load.starved > SHRINK_STARVED or load.busy > SHRINK_BUSY * (self.target - 1):
            self._quiet.clear()
            return None
        self._quiet.append(load)
        if sum(p.seconds for p in self._quiet) < SHRINK_AFTER_S:
            return None
        busiest = max(p.busy for p in self._quiet)
        size = max(self.least, math.ceil(busiest / SHRINK_BUSY))
        self._quiet.clear()
        if size >= self.target:
            return None
        workers = busiest / self.target
        self._step = 1
        self._recent.clear()
        self.target = size
        self.reason = (
            f"workers were at most {workers:.0%} busy and no task waited for {SHRINK_AFTER_S:.0f}s: shrinking to {size}"
        )
        return Resize(self.target, self.reason)
