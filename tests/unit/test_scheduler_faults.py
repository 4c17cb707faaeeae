"""The scheduler under faults, against a fake pool: it never dies of one, and it frees what hangs.

Each test reproduces a way the daemon used to wedge (issue 9): an exception
leaving the scheduler thread, a replacement worker that cannot start, a batch
that never returns, a leaky worker, a share consumer that never reads.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from support.fakes import FakePool, LedgerLog, catalog, drain, iter_spec, map_spec

import loaderd.server.scheduling.lifecycle as lifecycle_module
from loaderd.errors import BatchTimeoutError, WorkerCrashedError, exception_from_remote
from loaderd.server.pool.pool import PoolEvent, PoolLostError, WorkerMessage
from loaderd.server.scheduling.dispatcher import MAX_ATTEMPTS, Dispatcher
from loaderd.server.scheduling.lifecycle import MAX_RESPAWN_FAILURES, SlotState
from loaderd.server.scheduling.pool_protocol import SchedulerPolicy
from loaderd.server.scheduling.producer import WorkerSlots
from loaderd.server.scheduling.scheduler import Scheduler
from loaderd.server.scheduling.share import ShareKey
from loaderd.server.scheduling.stream import BatchStream
from loaderd.server.shm.arena import SlotRef
from loaderd.server.worker.tasks import IterTask, WorkerReady
from loaderd.v1 import loaderd_pb2 as pb

pytestmark = pytest.mark.timeout(20)


def make(pool: FakePool, policy: SchedulerPolicy | None = None, on_fatal: Any = None) -> Scheduler:
    return Scheduler(pool, LedgerLog().ledger(), catalog(), policy or SchedulerPolicy(share_buffer=4), on_fatal=on_fatal)


def plan(sched: Scheduler, stream: BatchStream, n: int) -> None:
    sched.add_plan(stream, [(i, i + 1) for i in range(stream.planned, stream.planned + n)], False)


def error_of(stream: BatchStream, seq: int) -> Exception:
    delivery = next(d for d in drain(stream) if d.seq == seq)
    assert delivery.error is not None, f"batch {seq} did not fail"
    return exception_from_remote(pb.RemoteError.FromString(delivery.error))


class FlakyPool(FakePool):
    """A pool whose ``poll`` raises ``failures`` times (or forever with -1) before working."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def poll(self, timeout: float, extra: Sequence[Any] = ()) -> list[PoolEvent]:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("pool exploded")
        return super().poll(timeout, extra)


def test_a_failing_round_is_logged_and_the_thread_carries_on() -> None:
    pool = FlakyPool(failures=3)
    sched = make(pool)
    stream = sched.open_stream(map_spec())
    sched.start()
    try:
        plan(sched, stream, 1)
        deadline = time.monotonic() + 10
        while not pool.batch_tasks() and time.monotonic() < deadline:
            stream.next_delivery(0.02)
        pool.finish(pool.batch_tasks()[0][1])
        sched.wake()
        delivery = stream.next_delivery(5.0)
        assert delivery is not None and delivery.seq == 0
        assert sched.running
    finally:
        sched.stop()


def test_a_scheduler_that_keeps_failing_says_so_once_and_stops() -> None:
    fatal: list[str] = []
    told = threading.Event()
    sched = make(FlakyPool(failures=-1), on_fatal=lambda why: (fatal.append(why), told.set()))
    sched.start()
    try:
        assert told.wait(10), "on_fatal was never called"
        assert sched.join(5), "the thread ended once it gave up"
        assert len(fatal) == 1 and "pool exploded" in fatal[0]
    finally:
        sched.stop()


def test_a_crash_error_for_a_position_past_uint64_is_still_delivered() -> None:
    # Issue 9.1: OpenStream start = 2**64-1 made capture_exception raise inside _on_death.
    pool = FakePool()
    sched = make(pool)
    stream = sched.open_stream(map_spec(window=1, start=2**64 - 1))
    plan(sched, stream, 1)
    for _ in range(MAX_ATTEMPTS):
        sched.step(0)
        worker, _ = pool.batch_tasks()[-1]
        pool.die(worker)
        sched.step(0)
    assert isinstance(error_of(stream, 2**64 - 1), WorkerCrashedError)


def test_a_replacement_that_cannot_start_is_retried_later(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle_module, "RESPAWN_BACKOFF_S", (0.01, 0.01))
    pool = FakePool()
    pool.respawn_error = OSError(errno.EMFILE, "Too many open files")
    sched = make(pool)
    pool.die(0)
    sched.step(0)  # must not raise
    assert pool.respawned == []
    pool.respawn_error = None
    deadline = time.monotonic() + 5
    while pool.respawned != [0] and time.monotonic() < deadline:
        sched.step(0.01)
    assert pool.respawned == [0]


def test_when_no_worker_can_start_the_scheduler_says_it_cannot_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle_module, "RESPAWN_BACKOFF_S", (0.001, 0.001))
    fatal: list[str] = []
    pool = FakePool()
    pool.respawn_error = OSError(errno.EMFILE, "Too many open files")
    sched = make(pool, on_fatal=fatal.append)
    pool.die(0)
    pool.die(1)
    deadline = time.monotonic() + 5
    while not fatal and time.monotonic() < deadline:
        sched.step(0.002)
    assert fatal and "no pool worker can start" in fatal[0]


def test_a_lost_pool_is_fatal_at_its_first_start_and_said_once() -> None:
    """PoolLostError (the fork server that held build: once datasets died): no backoff, no retries."""
    fatal: list[str] = []
    pool = FakePool()
    pool.respawn_error = PoolLostError("the pool's fork server (pid 7) died")
    sched = make(pool, on_fatal=fatal.append)
    pool.die(0)
    sched.step(0.001)
    pool.die(1)  # a death seen in a later round: not tried, not said again
    for _ in range(5):
        sched.step(0.001)
    assert fatal == ["the pool's fork server (pid 7) died"]
    assert pool.respawn_calls == 1


def step_until(sched: Scheduler, done: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        sched.step(0.005)
    assert done(), "not within the test's deadline"


def hanging_replacement(monkeypatch: pytest.MonkeyPatch, worker: int, start_timeout: float, backoff: float = 0.001) -> tuple[FakePool, Scheduler]:
    """A scheduler whose ``worker`` just died; its replacements hang while building until the test says."""
    monkeypatch.setattr(lifecycle_module, "RESPAWN_BACKOFF_S", (backoff, backoff))
    pool = FakePool()
    pool.hanging_starts.add(worker)
    sched = make(pool, SchedulerPolicy(share_buffer=4, start_timeout=start_timeout))
    pool.die(worker)
    return pool, sched


def test_a_replacement_that_hangs_while_building_is_killed_and_started_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a replacement whose dataset constructor hung held its slot for good (only the first start had a deadline)."""
    pool, sched = hanging_replacement(monkeypatch, 0, start_timeout=0.2)
    sched.step(0)
    assert pool.respawned == [0] and pool.stopped == [], "started, and given its start timeout"
    step_until(sched, lambda: pool.stopped != [])
    assert pool.stopped == [(0, True)], "killed once past its start timeout"
    pool.hanging_starts.clear()
    step_until(sched, lambda: pool.respawned == [0, 0])  # its death brings the next start
    sched.step(0)  # that one reports ready
    time.sleep(0.3)
    sched.step(0)
    assert pool.stopped == [(0, True)] and pool.ready[0], "a replacement that got ready is left alone"
    assert sched.snapshot().slots[0].state is SlotState.SERVING


def test_a_slot_whose_replacements_always_hang_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    pool, sched = hanging_replacement(monkeypatch, 1, start_timeout=0.01)
    step_until(sched, lambda: sched.snapshot().slots[1].state is SlotState.GIVEN_UP)
    assert pool.stopped == [(1, True)] * MAX_RESPAWN_FAILURES and pool.respawned == [1] * MAX_RESPAWN_FAILURES


def test_a_replica_owner_changes_only_when_its_own_slot_is_given_up() -> None:
    """Else a replica would move off a live worker (replayed from its start elsewhere) and its state
    there would outlive the stream: ReleaseStream goes to the owners of the day."""
    keys = range(60)
    slots = WorkerSlots(5)
    owners = {k: slots.owner(k) for k in keys}
    assert owners == {k: k % 5 for k in keys}
    for dead in (3, 0, 4, 1):
        slots = WorkerSlots(5, slots.given_up | {dead})
        now = {k: slots.owner(k) for k in keys}
        assert {k: now[k] for k in keys if owners[k] != dead} == {k: owners[k] for k in keys if owners[k] != dead}
        assert not set(now.values()) & slots.given_up
        if dead == 3:
            assert len({now[k] for k in keys if k % 5 == 3}) > 1, "the replicas of a given-up slot spread"
        owners = now
    assert set(owners.values()) == {2}


def test_a_replacement_that_got_ready_as_it_was_killed_still_counts_as_a_failed_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its WorkerReady was in the pipe when _check_starts killed it: reading it after must not reset the
    failure count, or a slot whose build always takes about start_timeout would never be given up."""
    pool, sched = hanging_replacement(monkeypatch, 0, start_timeout=0.05, backoff=60.0)
    sched.step(0)
    step_until(sched, lambda: pool.stopped != [])  # killed; its death waits in the pool's events
    pool.report_first(WorkerMessage(0, pool.generation[0], WorkerReady(0, {})))
    sched.step(0)
    slot = sched.snapshot().slots[0]
    assert (slot.state, slot.failed_starts) == (SlotState.WAITING, 1), "a failed start, retried after the backoff"
    assert slot.at is not None and slot.at > time.monotonic() + 30, "after the backoff"


def test_an_iterable_replica_on_a_slot_that_cannot_start_moves_to_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, its tasks waited for that slot for ever, then its stream failed UNAVAILABLE; with
    num_workers >= the pool size every new stream had a replica there, so no iterable could be served."""
    monkeypatch.setattr(lifecycle_module, "RESPAWN_BACKOFF_S", (0.001, 0.001))
    pool = FakePool()
    sched = make(pool)
    stream = sched.open_stream(iter_spec(replicas=2))
    sched.step(0)
    victim = next(w for w, task in pool.batch_tasks(stream.stream_id) if task.replica == 1)
    pool.respawn_error = OSError(errno.EMFILE, "Too many open files")
    pool.die(victim)  # holding replica 1's first batches: they come back as retries
    step_until(sched, lambda: sched.snapshot().slots[victim].state is SlotState.GIVEN_UP)
    before = len(pool.batch_tasks(stream.stream_id))
    finished: set[tuple[int, int]] = set()

    def moved() -> list[IterTask]:
        return [t for _, t in pool.batch_tasks(stream.stream_id)[before:] if isinstance(t, IterTask) and t.replica == 1]

    deadline = time.monotonic() + 5
    while len(moved()) < 3 and time.monotonic() < deadline:  # the other worker serves both replicas
        for worker, task in pool.batch_tasks(stream.stream_id):
            if worker != victim and (worker, id(task)) not in finished:  # a retry is the same task, sent again
                finished.add((worker, id(task)))
                pool.finish(task)
        sched.step(0.002)
        taken = len(drain(stream))
        if taken:
            sched.add_plan(stream, [], False, consumed=stream.delivered)  # the client's credit
    assert stream.failure is None
    assert {w for w, _ in pool.batch_tasks(stream.stream_id)[before:]} == {1 - victim}
    assert [t.batch_index for t in moved()[:3]] == [0, 1, 2], "replica 1 replayed from its first batch, in order"


def test_a_batch_past_its_task_timeout_kills_its_worker_and_fails_alone() -> None:
    pool = FakePool()
    dispatcher = Dispatcher(pool.size)
    sched = Scheduler(pool, LedgerLog().ledger(), catalog(), SchedulerPolicy(task_timeouts={"m": 0.05}), dispatcher=dispatcher)
    stream = sched.open_stream(map_spec(window=8))
    plan(sched, stream, 4)
    sched.step(0)
    on_0 = [t for w, t in pool.batch_tasks() if w == 0]
    for w, task in pool.batch_tasks():
        if w == 1:
            pool.finish(task)
    sched.step(0)
    time.sleep(0.1)  # worker 0's first batch is now past its 0.05 s
    sched.step(0)
    assert pool.stopped == [(0, True)]
    sched.step(0)  # the death: nothing is blamed, the queued batch runs again
    assert pool.respawned == [0]
    sched.step(0)
    rerun = pool.batch_tasks()[-1][1]
    assert rerun.seq == on_0[1].seq and dispatcher.attempts((stream.stream_id, rerun.seq)) == 0
    error = error_of(stream, on_0[0].seq)
    assert isinstance(error, BatchTimeoutError)
    assert "'m'" in str(error) and f"indices [{on_0[0].seq}, {on_0[0].seq + 1}]" in str(error) and "task_timeout" in str(error)


def recycling_worker_0(pool: FakePool) -> Scheduler:
    """A scheduler (max_tasks_per_worker=2) whose worker 0 has just done its share and been asked to exit."""
    sched = make(pool, SchedulerPolicy(max_tasks_per_worker=2))
    stream = sched.open_stream(map_spec(window=8))
    plan(sched, stream, 8)
    sched.step(0)
    for w, task in pool.batch_tasks():
        if w == 0:
            pool.finish(task)
    sched.step(0)
    return sched


def test_a_worker_is_recycled_after_its_share_of_batches() -> None:
    pool = FakePool()
    sched = recycling_worker_0(pool)
    assert pool.stopped == [(0, False)], "asked to exit once idle, not killed"
    sched.step(0)
    assert pool.respawned == [0]


def test_a_recycled_worker_that_does_not_exit_is_killed_after_a_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = FakePool()
    pool.lingering.add(0)
    sched = recycling_worker_0(pool)
    sched.step(0)
    assert pool.stopped == [(0, False)] and pool.respawned == [], "asked once; it lingers"
    monkeypatch.setattr(lifecycle_module, "RECYCLE_GRACE_S", 0.0)
    sched.step(0)
    assert pool.stopped == [(0, False), (0, True)], "killed after the grace"
    sched.step(0)
    sched.step(0)
    assert pool.respawned == [0] and pool.stopped == [(0, False), (0, True)]


def test_a_worker_over_its_memory_limit_is_recycled() -> None:
    pool = FakePool()
    sched = make(pool, SchedulerPolicy(worker_max_rss_bytes=1 << 30))
    stream = sched.open_stream(map_spec(window=8))
    plan(sched, stream, 2)
    sched.step(0)
    pool.rss[1] = 2 << 30
    for _, task in pool.batch_tasks():
        pool.finish(task)
    sched.step(0)
    assert pool.stopped == [(1, False)]


def test_a_share_consumer_that_never_reads_gets_no_more_than_its_window() -> None:
    # Issue 9.6: the pool produced a whole 20,000-batch plan for a consumer with window 8.
    pool = FakePool()
    sched = make(pool)
    key = ShareKey("s", 0, "m", "fp", True, 7)
    stream = sched.open_stream(map_spec(window=2), key)
    plan(sched, stream, 50)
    finished: set[int] = set()
    for _ in range(5):
        sched.step(0)
        for _, task in pool.batch_tasks():
            if task.seq not in finished:
                pool.finish(task)
                finished.add(task.seq)
    assert len(pool.batch_tasks()) == 2
    assert [d.seq for d in drain(stream)] == [0, 1]
    sched.step(0)
    assert len(pool.batch_tasks()) == 4, "reading moves the window on"


def test_a_batch_whose_slot_cannot_be_mapped_is_made_again_over_the_pipe() -> None:
    # Issue 9.2: out of descriptors, the daemon cannot map a worker's segment: degrade to the copy path.
    pool = FakePool()
    log = LedgerLog()
    sched = Scheduler(pool, log.ledger(), catalog(), SchedulerPolicy())
    stream = sched.open_stream(map_spec(window=1))
    plan(sched, stream, 1)
    sched.step(0)
    (_, task), = pool.batch_tasks()
    pool.finish(task, slot=SlotRef(name="loaderd-0-missing-w0g0-0", size=4096))
    sched.step(0)
    sched.step(0)
    _worker, again = pool.batch_tasks()[-1]
    assert again.seq == task.seq and again.inline and not task.inline
    assert log.given_back == [(pool.worker_of(task), 0, "loaderd-0-missing-w0g0-0")], "the slot goes back unmapped"
    pool.finish(again)
    sched.step(0)
    delivery = stream.next_delivery(0)
    assert delivery is not None and delivery.seq == task.seq and delivery.error is None
