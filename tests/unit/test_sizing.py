"""PoolSizer's rules, driven with made-up periods (no process, no clock): growth, its checks, shrinking, no oscillation."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from loaderd.server.scheduling.sizing import HOLD_S, SHRINK_AFTER_S, PoolLoad, PoolSizer, Resize

pytestmark = pytest.mark.timeout(30)

GIB = 1 << 30


@dataclasses.dataclass
class Machine:
    """A load the pool serves, as a sizer would see it each second: ``demand`` workers' worth of tasks ready
    (a trainer faster than the pool: more than there are workers), each worker using ``cpu_per_worker`` CPUs,
    on ``cpus`` CPUs, making ``per_worker`` batches/s while it has a CPU to run on."""

    demand: float
    cpu_per_worker: float
    cpus: float = 2.0
    per_worker: float = 10.0
    clients: int = 1
    memory_room: int = 64 * GIB
    worker_bytes: int = 100 << 20
    at: float = 0.0

    def period(self, workers: int) -> PoolLoad:
        self.at += 1.0
        busy = min(float(workers), self.demand)
        used = min(self.cpus, busy * self.cpu_per_worker)
        # Workers past the CPUs make nothing more: what they do is shared out.
        speed = used / (busy * self.cpu_per_worker) if busy else 1.0
        return PoolLoad(
            at=self.at,
            seconds=1.0,
            members=workers,
            serving=workers,
            busy=busy,
            starved=1.0 if self.demand > workers else 0.0,
            batches=round(busy * speed * self.per_worker),
            worker_cpu=used,
            idle_cpu=self.cpus - used,
            memory_room=self.memory_room - workers * self.worker_bytes,  # each worker takes its share
            memory_limit=64 * GIB,
            worker_bytes=self.worker_bytes,
            clients=self.clients,
        )


def run(sizer: PoolSizer, machine: Machine, periods: int) -> tuple[list[int], list[Resize]]:
    """The pool's size each period, and the changes, with workers ready as soon as asked for."""
    sizes, changes = [], []
    for _ in range(periods):
        resize = sizer.decide(machine.period(sizer.target))
        if resize is not None:
            changes.append(resize)
        sizes.append(sizer.target)
    return sizes, changes


def test_an_io_bound_load_grows_past_the_cpus_to_max_within_ten_seconds() -> None:
    sizer = PoolSizer(1, 8)
    sizes, changes = run(sizer, Machine(demand=20, cpu_per_worker=0.02), 60)
    assert sizes.index(8) < 10, sizes
    assert sizes[-40:] == [8] * 40
    assert [c.target for c in changes] == [2, 4, 8], "each growth paid in proportion: the step doubled"
    assert "growing to 2" in changes[0].reason and "tasks waited" in changes[0].reason


def test_a_cpu_bound_load_stops_at_the_cpus_and_says_why() -> None:
    sizer = PoolSizer(1, 8)
    sizes, changes = run(sizer, Machine(demand=20, cpu_per_worker=1.0, cpus=2.0), 120)
    assert sizes[-100:] == [2] * 100, sizes  # never probes past the cores: no oscillation either
    assert [c.target for c in changes] == [2]
    assert sizer.held.startswith("no idle CPU for another worker")


def test_growth_stops_before_memory_runs_short() -> None:
    # 10% of the 64 GiB limit stays free (6.4 GiB); 4.5 GiB past it hold 4 workers of 1 GiB, no 5th.
    machine = Machine(demand=20, cpu_per_worker=0.02, memory_room=int(6.4 * GIB) + int(4.5 * GIB), worker_bytes=GIB)
    sizer = PoolSizer(1, 8)
    sizes, _ = run(sizer, machine, 30)
    assert max(sizes) == 4, sizes
    assert sizer.held.startswith("memory:"), sizer.held


def test_a_growth_that_does_not_pay_is_undone_and_not_retried_until_the_hold_ends() -> None:
    """A dataset held back by something other than CPU (a lock, a disk): more workers make nothing more."""
    sizer = PoolSizer(1, 4)
    machine = Machine(demand=20, cpu_per_worker=0.02)
    first = sizer.decide(machine.period(1))
    assert first is not None and first.target == 2

    def flat(workers: int) -> PoolLoad:  # every worker busy, tasks waiting, and 10 batches/s whatever the size
        return dataclasses.replace(machine.period(workers), batches=10)

    changes = []
    for _ in range(int(HOLD_S[0]) - 10):
        resize = sizer.decide(flat(sizer.target))
        if resize is not None:
            changes.append(resize)
    assert [c.target for c in changes] == [1], changes
    assert "back to 1" in changes[0].reason and "a growth must gain 7%" in changes[0].reason
    assert "did not pay" in sizer.held
    # Clients come or go: the load changed, and so may what pays.
    machine.clients = 2
    assert sizer.decide(flat(1)) == Resize(2, sizer.reason)


def test_idle_trainers_bring_the_pool_back_to_min_in_one_step() -> None:
    sizer = PoolSizer(2, 8)
    machine = Machine(demand=20, cpu_per_worker=0.02)
    run(sizer, machine, 30)
    assert sizer.target == 8
    machine.demand = 0
    sizes, changes = run(sizer, machine, int(SHRINK_AFTER_S) + 2)
    assert sizes[-1] == 2 and [c.target for c in changes] == [2]
    assert "shrinking to 2" in changes[0].reason


def test_trainers_that_leave_while_a_growth_is_checked_let_the_pool_shrink_at_once() -> None:
    sizer = PoolSizer(1, 8)
    machine = Machine(demand=20, cpu_per_worker=0.02)
    assert sizer.decide(machine.period(1)) == Resize(2, sizer.reason)  # a growth, now being checked
    machine.demand = 0
    sizes, changes = run(sizer, machine, int(SHRINK_AFTER_S) + 3)
    assert [c.target for c in changes] == [1] and sizes[-1] == 1, sizes


def test_a_lighter_load_shrinks_to_the_workers_it_keeps_busy() -> None:
    """A GPU-bound trainer: 2.5 workers' worth of work, no task waiting: 4 workers (2.5 / 0.7 busy) are enough."""
    sizer = PoolSizer(1, 8)
    machine = Machine(demand=20, cpu_per_worker=0.02)
    run(sizer, machine, 30)
    machine.demand = 2.5
    sizes, _ = run(sizer, machine, 20)
    assert sizes[-1] == 4, sizes


def test_a_steady_load_never_oscillates() -> None:
    """Loads at the thresholds' edges: once settled, the size holds, but for a probe of one more worker (a few
    seconds, undone) each time the hold on a size that did not pay ends: after 60 s, then 120 s, 240 s..."""
    for demand in (0.6, 1.0, 1.4, 2.1, 2.8, 3.5, 5.0, 7.7):
        sizer = PoolSizer(1, 8)
        sizes, _ = run(sizer, Machine(demand=demand, cpu_per_worker=0.05), 500)
        settled = max(set(sizes[-100:]), key=sizes[-100:].count)
        probes = [i for i in range(100, 500) if sizes[i] != settled and sizes[i - 1] == settled]
        assert len(probes) <= 2, (demand, sizes)
        assert all(b - a >= HOLD_S[0] for a, b in itertools.pairwise(probes)), (demand, probes)
        assert sum(size != settled for size in sizes[100:]) <= 5 * len(probes), (demand, sizes)
        assert settled >= min(demand, 8) * 0.7, (demand, settled)
