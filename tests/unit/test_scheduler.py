"""The scheduler against a fake pool: dispatch, fairness, windows, routing, crash recovery.

No processes and no gRPC: each test drives ``Scheduler.step`` by hand and says
what the fake workers did.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pytest
from support.fakes import FakePool, LedgerLog, catalog, drain, iter_spec, map_spec

from loaderd.errors import exception_from_remote
from loaderd.server.pool.pool import PoolEvent
from loaderd.server.scheduling import scheduler as scheduler_module
from loaderd.server.scheduling.dispatcher import MAX_ATTEMPTS, PER_WORKER, Dispatcher, InFlight, TaskKey
from loaderd.server.scheduling.pool_protocol import SchedulerPolicy
from loaderd.server.scheduling.producer import END, FailReason, StreamFailed, WorkerSlots
from loaderd.server.scheduling.scheduler import Scheduler
from loaderd.server.scheduling.share import ShareKey, ShareMismatchError
from loaderd.server.scheduling.stream import BatchStream
from loaderd.server.worker.tasks import FetchTask, IterTask, ReleaseStream, Task
from loaderd.v1 import loaderd_pb2 as pb

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def pool() -> FakePool:
    return FakePool(size=2)


@pytest.fixture
def scheduler(pool: FakePool) -> Iterator[Scheduler]:
    observed: list[tuple[str, float]] = []
    sched = Scheduler(pool, LedgerLog().ledger(), catalog(), SchedulerPolicy(share_buffer=4), on_batch=lambda d, s: observed.append((d, s)))
    sched.observed = observed  # type: ignore[attr-defined]
    yield sched
    sched.stop()


def plan(sched: Scheduler, stream, n: int, start: int = 0, end: bool = True) -> None:
    sched.add_plan(stream, [(i, i + 1) for i in range(start, start + n)], end)


def test_dispatch_fills_each_worker_to_its_queue_limit(scheduler: Scheduler, pool: FakePool) -> None:
    stream = scheduler.open_stream(map_spec(window=64))
    plan(scheduler, stream, 20)
    scheduler.step(0)
    per_worker = [sum(1 for w, _ in pool.batch_tasks() if w == worker) for worker in range(pool.size)]
    assert per_worker == [PER_WORKER] * pool.size
    assert [t.seq for _, t in pool.batch_tasks()] == list(range(PER_WORKER * pool.size))


def test_round_robin_between_streams(scheduler: Scheduler, pool: FakePool) -> None:
    a = scheduler.open_stream(map_spec(window=64))
    b = scheduler.open_stream(map_spec(window=64))
    plan(scheduler, a, 10)
    plan(scheduler, b, 10)
    scheduler.step(0)
    owners = [t.stream_id for _, t in pool.batch_tasks()]
    assert sorted(owners) == sorted([a.stream_id, b.stream_id] * PER_WORKER), owners


def test_window_bounds_what_is_dispatched_until_delivered(scheduler: Scheduler, pool: FakePool) -> None:
    stream = scheduler.open_stream(map_spec(window=2))
    plan(scheduler, stream, 10)
    scheduler.step(0)
    first = pool.batch_tasks()
    assert [t.seq for _, t in first] == [0, 1]
    for _, task in first:
        pool.finish(task)
    scheduler.step(0)
    assert len(pool.batch_tasks()) == 2, "a full window must wait for the client, not the pool"
    assert [d.seq for d in drain(stream)] == [0, 1]
    scheduler.step(0)
    assert [t.seq for _, t in pool.batch_tasks()] == [0, 1, 2, 3]


def test_results_out_of_order_are_delivered_in_order(scheduler: Scheduler, pool: FakePool) -> None:
    stream = scheduler.open_stream(map_spec(window=8))
    plan(scheduler, stream, 4)
    scheduler.step(0)
    tasks = [t for _, t in pool.batch_tasks()]
    for task in reversed(tasks):
        pool.finish(task, value=f"b{task.seq}".encode())
    scheduler.step(0)
    deliveries = drain(stream)
    assert [d.seq for d in deliveries] == [0, 1, 2, 3, -1]
    assert [d.batch.done.value for d in deliveries[:4]] == [b"b0", b"b1", b"b2", b"b3"]
    assert deliveries[-1] is END
    assert stream.delivered == 4
    assert scheduler.counters["m"].batches_computed == 4
    assert [d for d, _ in scheduler.observed] == ["m"] * 4  # type: ignore[attr-defined]


def test_map_tasks_carry_the_plan_and_a_seed_per_position(scheduler: Scheduler, pool: FakePool) -> None:
    stream = scheduler.open_stream(map_spec(window=8, start=5))
    scheduler.add_plan(stream, [(3, 1), (4, 4)], True)
    scheduler.step(0)
    tasks = [t for _, t in pool.batch_tasks()]
    assert [(t.seq, t.indices) for t in tasks] == [(5, (3, 1)), (6, (4, 4))]
    assert all(isinstance(t, FetchTask) for t in tasks)
    assert len({t.seed for t in tasks}) == 2


def test_a_dead_worker_is_replaced_and_its_tasks_rerun_first(scheduler: Scheduler, pool: FakePool) -> None:
    full = PER_WORKER * pool.size
    stream = scheduler.open_stream(map_spec(window=full))
    plan(scheduler, stream, full + 2)
    scheduler.step(0)
    lost = [t.seq for w, t in pool.batch_tasks() if w == 0]
    pool.die(0)
    scheduler.step(0)  # the death is handled ...
    assert pool.respawned == [0]
    scheduler.step(0)  # ... and the lost tasks go out again, before new work
    rerun = [t for _, t in pool.batch_tasks()[full:]]
    assert [t.seq for t in rerun] == lost
    survivors = [t for w, t in pool.batch_tasks()[:full] if w == 1]
    for task in rerun + survivors:
        pool.finish(task)
    scheduler.step(0)
    assert [d.seq for d in drain(stream)] == list(range(full))


def test_a_batch_that_kills_its_worker_three_times_becomes_an_error(scheduler: Scheduler, pool: FakePool) -> None:
    stream = scheduler.open_stream(map_spec(window=1))
    plan(scheduler, stream, 2)
    for _ in range(MAX_ATTEMPTS):
        scheduler.step(0)
        worker, task = pool.batch_tasks()[-1]
        assert task.seq == 0
        pool.die(worker)
        scheduler.step(0)
    first = drain(stream)[0]
    assert first.seq == 0 and first.error is not None
    error = exception_from_remote(pb.RemoteError.FromString(first.error))
    assert type(error).__name__ == "WorkerCrashedError" and "died 3 times" in str(error)
    scheduler.step(0)
    assert pool.batch_tasks()[-1][1].seq == 1, "the epoch goes on after the skipped batch"


def test_results_of_a_closed_stream_are_dropped(scheduler: Scheduler, pool: FakePool) -> None:
    stream = scheduler.open_stream(map_spec(window=4))
    plan(scheduler, stream, 4)
    scheduler.step(0)
    scheduler.close_stream(stream)
    for _, task in pool.batch_tasks():
        pool.finish(task)
    scheduler.step(0)
    assert stream.ready == {}
    assert scheduler.counters["m"].delivered_closed == 0
    scheduler.close_stream(stream)  # idempotent


def test_iterable_replicas_stay_on_their_worker_and_stop_when_spent(scheduler: Scheduler, pool: FakePool) -> None:
    stream = scheduler.open_stream(iter_spec(replicas=2, window=4))
    scheduler.step(0)
    tasks = pool.batch_tasks()
    assert all(isinstance(t, IterTask) for _, t in tasks)
    assert {(t.replica, w) for w, t in tasks} == {(0, (stream.stream_id + 0) % 2), (1, (stream.stream_id + 1) % 2)}
    assert [t.replica for _, t in tasks] == [0, 1, 0, 1], "torch's round-robin over replicas"
    replica0 = [t for _, t in tasks if t.replica == 0]
    replica1 = [t for _, t in tasks if t.replica == 1]
    pool.finish(replica0[0])
    pool.exhaust(replica1[0])
    pool.finish(replica0[1])
    pool.exhaust(replica1[1])
    scheduler.step(0)
    assert [d.seq for d in drain(stream)] == [0, 2], "a spent replica's positions are skipped"
    scheduler.add_plan(stream, [], False, consumed=2)
    scheduler.step(0)
    later = [t for _, t in pool.batch_tasks()[4:]]
    assert later and all(t.replica == 0 for t in later), "a spent replica gets no more tasks"
    for task in later:
        pool.exhaust(task)
    scheduler.step(0)
    assert drain(stream) == [END]
    scheduler.close_stream(stream)
    released = {w for w, t in pool.submitted if isinstance(t, ReleaseStream)}
    assert released == {0, 1}, "each worker holding a replica forgets it"


def test_iterable_credit_bounds_production_past_consumption(scheduler: Scheduler, pool: FakePool) -> None:
    stream = scheduler.open_stream(iter_spec(replicas=1, window=2))
    for _ in range(3):
        scheduler.step(0)
        for _, task in pool.batch_tasks()[-2:]:
            pool.finish(task)
        scheduler.step(0)
        drain(stream)  # delivered, but the client has not reported consuming them
    assert len(pool.batch_tasks()) == 2
    scheduler.add_plan(stream, [], False, consumed=2)
    scheduler.step(0)
    assert len(pool.batch_tasks()) == 4


def test_shared_job_runs_each_position_once_for_every_consumer(scheduler: Scheduler, pool: FakePool) -> None:
    key = ShareKey("sweep", 0, "m", "fp", True, 7)
    a = scheduler.open_stream(map_spec(window=8), key)
    b = scheduler.open_stream(map_spec(window=8), key)
    plan(scheduler, a, 3)
    plan(scheduler, b, 3)
    scheduler.step(0)
    tasks = [t for _, t in pool.batch_tasks()]
    assert sorted(t.seq for t in tasks) == [0, 1, 2]
    for task in tasks:
        pool.finish(task)
    scheduler.step(0)
    assert [d.seq for d in drain(a)] == [0, 1, 2, -1]
    assert [d.seq for d in drain(b)] == [0, 1, 2, -1]
    assert [j.produced for j in scheduler.snapshot().jobs] == [3]
    scheduler.close_stream(a)
    assert len(scheduler.snapshot().jobs) == 1
    scheduler.close_stream(b)
    assert scheduler.snapshot().jobs == (), "the job ends with its last consumer"


def test_a_plan_that_arrives_after_its_consumer_closed_is_ignored(scheduler: Scheduler, pool: FakePool) -> None:
    key = ShareKey("late", 0, "m", "fp", True, 7)
    a = scheduler.open_stream(map_spec(window=8), key)
    b = scheduler.open_stream(map_spec(window=8), key)
    plan(scheduler, a, 1)
    scheduler.step(0)
    pool.finish(pool.batch_tasks()[0][1])
    scheduler.step(0)
    scheduler.close_stream(b)
    plan(scheduler, b, 1)  # buffered at the job: it must not be handed to the closed stream
    assert b.ready == {} and [j.waiting for j in scheduler.snapshot().jobs] == [0]


def test_a_share_refuses_a_loader_with_other_parameters(scheduler: Scheduler) -> None:
    scheduler.open_stream(map_spec(), ShareKey("s", 0, "m", "fp", True, 7))
    with pytest.raises(ShareMismatchError, match="same parameters"):
        scheduler.open_stream(map_spec(), ShareKey("s", 0, "m", "other", True, 7))
    with pytest.raises(ShareMismatchError, match="base seed"):
        scheduler.open_stream(map_spec(), ShareKey("s", 0, "m", "fp", True, 8))


def test_stop_fails_every_stream_with_unavailable(scheduler: Scheduler) -> None:
    stream = scheduler.open_stream(map_spec())
    scheduler.stop("going away")
    with pytest.raises(StreamFailed) as failed:
        stream.next_delivery(0)
    assert failed.value.reason is FailReason.UNAVAILABLE and "going away" in str(failed.value)
    # A stream opened after (a call that got past the drain check as the daemon stopped) fails alike,
    # instead of waiting for a scheduler thread that is gone until gRPC's grace ends the call.
    late = scheduler.open_stream(map_spec())
    with pytest.raises(StreamFailed) as failed:
        late.next_delivery(0)
    assert failed.value.reason is FailReason.UNAVAILABLE and "going away" in str(failed.value)


def test_the_thread_runs_steps_until_stopped(pool: FakePool) -> None:
    sched = Scheduler(pool, LedgerLog().ledger(), catalog(), SchedulerPolicy(share_buffer=4))
    stream = sched.open_stream(map_spec(window=4))
    sched.start()
    plan(sched, stream, 1)
    task = None
    for _ in range(200):
        tasks = pool.batch_tasks()
        if tasks:
            task = tasks[0][1]
            break
        stream.next_delivery(0.01)
    assert task is not None, "the scheduler thread never dispatched"
    pool.finish(task)
    sched.wake()
    assert stream.next_delivery(5.0).seq == 0
    sched.stop()
    assert "loaderd-scheduler" not in {t.name for t in threading.enumerate()}



class WatchedPool(FakePool):
    """Notes, each time the scheduler waits for it, whether a servicer still waits on ``watched``'s condition."""

    def __init__(self) -> None:
        super().__init__(size=2)
        self.watched: BatchStream | None = None
        self.servicer_waiting: list[bool] = []

    def poll(self, timeout: float, extra: Sequence[Any] = ()) -> list[PoolEvent]:
        if self.watched is not None:
            self.servicer_waiting.append(bool(self.watched.cond._waiters))  # type: ignore[attr-defined]
        return super().poll(timeout, extra)


class ProbedDispatcher(Dispatcher):
    """Notes whether a servicer still waits on ``watched``'s condition when it dispatches; ``fail_dispatch`` and
    ``fail_running`` make a round fail (before the pool is polled, or after, in the task deadlines' check)."""

    watched: BatchStream | None = None
    fail_dispatch = False
    fail_running = False

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.servicer_waiting: list[bool] = []

    def dispatch(self, ready: Iterable[int], slots: WorkerSlots, submit: Callable[[int, Task], None]) -> None:
        if self.watched is not None:
            self.servicer_waiting.append(bool(self.watched.cond._waiters))  # type: ignore[attr-defined]
        if self.fail_dispatch:
            raise RuntimeError("dispatch failed")
        super().dispatch(ready, slots, submit)

    def running(self) -> Iterator[tuple[int, TaskKey, InFlight]]:
        if self.fail_running:
            raise RuntimeError("the deadlines' check failed")
        return super().running()


def _servicer_waiting(stream: BatchStream) -> tuple[threading.Thread, list[Any]]:
    """A thread waiting (up to 5 s) in ``next_delivery`` as a servicer does, and the list its delivery goes to; returned
    once it waits on the stream's condition (CPython's Condition lists its waiters: a notify takes them off at once)."""
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(stream.next_delivery(5.0)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 5.0
    while not stream.cond._waiters and time.monotonic() < deadline:  # type: ignore[attr-defined]
        thread.join(0.001)
    assert stream.cond._waiters, "the servicer never waited"  # type: ignore[attr-defined]
    return thread, got


def _with_a_batch_resolved(sched: Scheduler, pool: FakePool) -> tuple[BatchStream, threading.Thread, list[Any]]:
    """A stream whose servicer waits, and whose first batch the fake pool has finished (the next poll hands it over)."""
    stream = sched.open_stream(map_spec(window=4))
    plan(sched, stream, 1)
    sched.step(0)
    thread, got = _servicer_waiting(stream)
    pool.finish(pool.batch_tasks()[0][1])
    return stream, thread, got


def test_a_servicer_is_woken_for_its_batch_after_the_next_dispatch_before_the_scheduler_waits() -> None:
    """A round's results are handled under the lock, and so is the dispatch: a servicer woken before either is done
    would block on the lock (and the GIL) at once and wake again (server/scheduling/held_wakeups.py)."""
    pool = WatchedPool()
    dispatcher = ProbedDispatcher(pool.size)
    sched = Scheduler(pool, LedgerLog().ledger(), catalog(), SchedulerPolicy(share_buffer=4), dispatcher=dispatcher)
    try:
        stream, thread, got = _with_a_batch_resolved(sched, pool)
        pool.watched = dispatcher.watched = stream
        sched.step(0)  # the batch is resolved: the servicer's wake-up is held ...
        assert stream.cond._waiters, "woken before the scheduler waited again"  # type: ignore[attr-defined]
        sched.step(0)  # ... through the next dispatch, and no longer once the scheduler waits for the pool
        assert dispatcher.servicer_waiting == [True, True]
        assert pool.servicer_waiting == [True, False]
        thread.join(5.0)
        assert [d.seq for d in got] == [0]
    finally:
        sched.stop()


def test_a_round_whose_dispatch_fails_still_wakes_the_servicers_it_held() -> None:
    pool = FakePool(size=2)
    dispatcher = ProbedDispatcher(pool.size)
    sched = Scheduler(pool, LedgerLog().ledger(), catalog(), SchedulerPolicy(share_buffer=4), dispatcher=dispatcher)
    try:
        _, thread, got = _with_a_batch_resolved(sched, pool)
        sched.step(0)
        dispatcher.fail_dispatch = True
        with pytest.raises(RuntimeError, match="dispatch failed"):
            sched.step(0)
        thread.join(5.0)
        assert [d.seq for d in got] == [0]
    finally:
        sched.stop()


def test_a_scheduler_that_gives_up_wakes_the_servicers_it_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its thread ends mid-round (the round failed once too often): nothing would wake them after."""
    monkeypatch.setattr(scheduler_module, "FATAL_FAILURES", 1)
    pool = FakePool(size=2)
    dispatcher = ProbedDispatcher(pool.size)
    fatal: list[str] = []
    policy = SchedulerPolicy(share_buffer=4, task_timeouts={"m": 60.0})  # the deadlines' check runs each round
    sched = Scheduler(pool, LedgerLog().ledger(), catalog(), policy, on_fatal=fatal.append, dispatcher=dispatcher)
    try:
        _, thread, got = _with_a_batch_resolved(sched, pool)
        dispatcher.fail_running = True  # the thread's first round resolves the batch, then fails
        sched.start()
        assert sched.join(5.0), "the scheduler did not give up"
        thread.join(5.0)
        assert [d.seq for d in got] == [0]
        assert fatal and "the deadlines' check failed" in fatal[0]
    finally:
        sched.stop()


def test_every_failure_reason_has_one_status() -> None:
    """The daemon's domain says why a stream failed; the RPC layer alone turns that into a gRPC status
    (pyproject's import-linter contracts keep grpc out of the domain layers)."""
    from loaderd.server.rpc.refusals import FAILURES as _FAILURES

    assert set(_FAILURES) == set(FailReason)
