"""An elastic pool's mechanics on a fake pool: slots join and leave between batches, nothing is lost or run twice,
iterable replicas stay where they were placed until their worker leaves, and the dispatcher's clocks."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from support.fakes import FakeClock, FakePool, LedgerLog, catalog, drain, iter_spec, map_spec

from loaderd.server.scheduling.dispatcher import PER_WORKER, Dispatcher
from loaderd.server.scheduling.lifecycle import SlotState, WorkerLifecycle
from loaderd.server.scheduling.pool_protocol import SchedulerPolicy
from loaderd.server.scheduling.producer import WorkerSlots
from loaderd.server.scheduling.scheduler import Scheduler
from loaderd.server.scheduling.stream import BatchStream
from loaderd.server.worker.tasks import FetchTask, IterTask

pytestmark = pytest.mark.timeout(30)


def elastic(size: int = 3, least: int = 1) -> tuple[FakePool, Scheduler]:
    """A scheduler on an elastic pool of ``size`` slots, ``least`` of them started."""
    pool = FakePool(size)
    for worker_id in range(least, size):
        pool.ready[worker_id] = False  # parked: no worker there
    # A clock that stands still: the sizing never acts on its own; the test resizes.
    sched = Scheduler(pool, LedgerLog().ledger(), catalog(), SchedulerPolicy(min_workers=least), clock=lambda: 0.0)
    return pool, sched


def resize(sched: Scheduler, target: int) -> None:
    """What the sizer's decision does (server/scheduling/elastic.py), then a round to act on it."""
    sched._supervisor.resize(target, sched._dispatcher.idle, sched._pinned)
    sched.step(0)


def finish_all(pool: FakePool, done: set[int]) -> None:
    for _, task in pool.batch_tasks():
        if id(task) not in done:
            done.add(id(task))
            pool.finish(task)


def step_until(sched: Scheduler, done: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        sched.step(0.005)
    assert done(), "not within the test's deadline"


def test_a_pool_grows_and_shrinks_between_batches_and_every_batch_comes_once_in_order() -> None:
    pool, sched = elastic(3, 1)
    stream = sched.open_stream(map_spec(window=12))
    sched.add_plan(stream, [(i, i + 1) for i in range(0, 80, 2)], True)
    sched.step(0)
    assert {w for w, _ in pool.batch_tasks()} == {0}, "a parked slot gets no task"
    assert sched.snapshot().members == 1 and sched.snapshot().slots[2].state is SlotState.PARKED
    resize(sched, 3)
    assert sorted(pool.respawned) == [1, 2], "parked slots start as replacements do"
    sched.step(0)  # their WorkerReady
    done: set[int] = set()
    delivered = []
    shrunk = False
    while len(delivered) < 41:
        finish_all(pool, done)
        sched.step(0)
        delivered += drain(stream)
        if not shrunk and len(delivered) >= 10:
            assert {w for w, _ in pool.batch_tasks()} == {0, 1, 2}
            resize(sched, 1)  # workers 2 and 1 leave once idle: their queued batches finish first
            shrunk = True
    assert [d.seq for d in delivered] == [*range(40), -1]
    assert all(d.error is None for d in delivered[:-1])
    assert sorted(pool.removed) == [1, 2] and all(kill is False for _, kill in pool.stopped)
    seqs = [t.seq for _, t in pool.batch_tasks() if isinstance(t, FetchTask)]
    assert sorted(seqs) == list(range(40)), "no batch was run twice"
    assert sched.snapshot().members == 1


def test_iterable_replicas_stay_where_placed_when_slots_join_and_move_when_theirs_leaves() -> None:
    pool, sched = elastic(3, 1)
    resize(sched, 2)
    sched.step(0)  # slot 1's WorkerReady
    stream: BatchStream = sched.open_stream(iter_spec(replicas=4, window=8))
    sched.step(0)
    placed = dict(stream.replica_slot)  # where each replica went (or waits to go) first
    assert len(placed) == 4 and set(placed.values()) == {0, 1}
    resize(sched, 3)
    sched.step(0)
    done: set[int] = set()
    for _ in range(6):  # the pool serves on; each replica's batches keep going to the worker that holds it
        finish_all(pool, done)
        sched.step(0)
        drain(stream)
        sched.add_plan(stream, [], False, consumed=stream.delivered)
    for worker, task in pool.batch_tasks(stream.stream_id):
        assert isinstance(task, IterTask) and worker == placed[task.replica], "a joining slot moved no replica"
    # The slot holding fewer replicas leaves first (the higher of two alike): fewer replicas to replay.
    leaving = min((0, 1), key=lambda w: (sum(s == w for s in placed.values()), -w))
    staying = 1 - leaving
    moved_replicas = {r for r, w in placed.items() if w == leaving}
    before = len(pool.batch_tasks(stream.stream_id))
    resize(sched, 2)  # slot 2 holds no replica: it leaves
    step_until(sched, lambda: sched.snapshot().slots[2].state is SlotState.PARKED)
    resize(sched, 1)  # now the one of 0 and 1 with fewer replicas
    for _ in range(20):
        finish_all(pool, done)
        sched.step(0.002)
        drain(stream)
        sched.add_plan(stream, [], False, consumed=stream.delivered)
    assert sched.snapshot().slots[leaving].state is SlotState.PARKED
    later = pool.batch_tasks(stream.stream_id)[before:]
    assert {w for w, _ in later} <= {staying}
    replays = [t for _, t in later if isinstance(t, IterTask) and t.replica in moved_replicas]
    assert replays, "the replicas of the slot that left run on the other worker"
    assert stream.failure is None


def test_a_parked_slot_takes_no_work_and_plans_no_start() -> None:
    slots = WorkerLifecycle(3, serving=1)
    assert slots.parked() == {1, 2} and slots.members() == [0]
    assert slots.respawn(2) is None and slots.due() == []
    slots.join(2)
    assert slots.due() == [2] and slots.members() == [0, 2]
    slots.started(2)
    slots.ready(2, 1)
    slots.leave(2)
    assert not slots.takes_work(2) and slots.leaving() == {2} and slots.members() == [0]
    assert slots.exit_when_idle(2, idle=True)
    slots.asked_to_exit(2, 1)
    assert slots.died(2, 1) is True, "a worker asked to leave dies expected"
    assert slots.view(2).state is SlotState.PARKED and slots.leaving() == frozenset()
    assert slots.respawn(2) is None and slots.due() == []


def test_worker_slots_place_new_work_on_present_slots_and_keep_placed_work() -> None:
    slots = WorkerSlots(4, parked=frozenset({2, 3}))
    owners = {slots.owner(k) for k in range(40)}
    assert owners == {0, 1}
    assert slots.place(6, current=None) in {0, 1}
    joined = WorkerSlots(4, parked=frozenset({3}))
    assert joined.place(6, current=1) == 1, "a slot joining moves nothing"
    left = WorkerSlots(4, parked=frozenset({1, 3}))
    assert left.place(6, current=1) in {0, 2}, "work on a slot that left moves"
    assert WorkerSlots(4, leaving=frozenset({0})).owner(4) != 0, "new work avoids a leaving slot"



def test_the_dispatcher_clocks_busy_worker_seconds_and_starved_seconds() -> None:
    clock = FakeClock()
    dispatcher = Dispatcher(2, clock)
    pool = FakePool(2)
    sched = Scheduler(pool, LedgerLog().ledger(), catalog(), SchedulerPolicy(), dispatcher=dispatcher)
    full = 2 * PER_WORKER
    stream = sched.open_stream(map_spec(window=3 * full))
    sched.add_plan(stream, [(i,) for i in range(3 * full)], False)
    sched.step(0)  # PER_WORKER tasks each: both workers full, the rest of the plan waits
    clock.now += 2.0
    assert dispatcher.clocks() == (4.0, 2.0)
    for _, task in pool.batch_tasks():
        pool.finish(task)
    sched.step(0)  # the results (the workers idle)
    sched.step(0)  # the next ones go out: still full, still waiting
    clock.now += 1.0
    busy, starved = dispatcher.clocks()
    assert (busy, starved) == (6.0, 3.0)


def test_a_small_pool_still_sees_a_stream_it_cannot_keep_up_with() -> None:
    """A window sized for 8 workers (prefetch 2: 16 batches) on a pool of 1: the stream works a share of it ahead,
    but always more than the pool's workers hold, so that the pool sees it waits (and grows)."""
    pool, sched = elastic(8, 1)
    stream = sched.open_stream(map_spec(window=16))
    assert stream.dispatch_window == PER_WORKER * (1 + 1) + 1
    sched.add_plan(stream, [(i,) for i in range(40)], False)
    sched.step(0)
    assert len(pool.batch_tasks()) == PER_WORKER and stream.wants_dispatch(), "one worker full, and the stream wants more"
    sched._resized(8)
    assert stream.dispatch_window == 16, "the whole window once the pool is at its most"


def test_an_elastic_pool_s_tasks_never_go_grouped() -> None:
    """Groups make a worker's batches arrive together and its queue run dry between them: the sizing would read the
    pool as idle and keep it small (a model of it stalled at 8 of 32 workers). Quick batches or not, none is grouped."""
    pool, sched = elastic(2, 2)
    try:
        stream = sched.open_stream(map_spec(window=16))
        sched.add_plan(stream, [(i,) for i in range(40)], False)
        for _ in range(3):
            sched.step(0)
            for _, task in pool.batch_tasks():
                pool.finish(task)  # at once: a quick dataset
            sched.step(0)
            drain(stream)
        tasks = [t for _, t in pool.batch_tasks()]
        assert len(tasks) > 2 * PER_WORKER and not any(isinstance(t, FetchTask) and t.grouped for t in tasks)
    finally:
        sched.stop()
