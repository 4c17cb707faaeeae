"""BatchStream alone: ordering, windows, duplicates, resume, END. No scheduler, pool or gRPC."""

from __future__ import annotations

import threading
import time

import pytest
from support.fakes import batch_delivery, dispatch_all, drain, iter_spec, lone_stream, map_spec

from loaderd.server.scheduling.ledger import FinishedBatch
from loaderd.server.scheduling.producer import END, Delivery, FailReason, StreamFailed
from loaderd.server.worker.tasks import FetchTask, IterTask

pytestmark = pytest.mark.timeout(10)


def test_map_stream_dispatches_its_plan_up_to_the_window() -> None:
    stream = lone_stream(map_spec(window=3))
    stream.add_plan([(0,), (1,), (2,), (3,)], end=True)
    tasks = dispatch_all(stream)
    assert [(t.seq, t.indices) for t in tasks] == [(0, (0,)), (1, (1,)), (2, (2,))]
    assert all(isinstance(t, FetchTask) for t in tasks)
    assert stream.queued() == 1 and stream.in_flight() == 3


def test_out_of_order_results_come_out_in_order_then_end() -> None:
    stream = lone_stream(map_spec(window=8))
    stream.add_plan([(0,), (1,), (2,)], end=True)
    dispatch_all(stream)
    for seq in (2, 0, 1):
        stream.resolve(batch_delivery(seq))
    assert [d.seq for d in drain(stream)] == [0, 1, 2, -1]
    assert stream.finished and stream.delivered == 3


def test_taking_a_batch_out_says_whether_it_freed_a_full_window() -> None:
    """The servicer wakes the scheduler only when a delivery let dispatch go on (one wake-up less per batch)."""
    stream = lone_stream(map_spec(window=2))
    stream.add_plan([(0,), (1,), (2,), (3,), (4,)], end=True)
    assert [t.seq for t in dispatch_all(stream)] == [0, 1]
    stream.resolve(batch_delivery(0))
    stream.resolve(batch_delivery(1))
    assert stream.next_delivery(0).seq == 0 and stream.window_freed  # the window was full, plan waiting
    assert [t.seq for t in dispatch_all(stream)] == [2]
    assert stream.next_delivery(0).seq == 1 and stream.window_freed
    assert [t.seq for t in dispatch_all(stream)] == [3]
    stream.resolve(batch_delivery(2))
    assert not dispatch_all(stream)  # full again: 2 ready, 3 computing
    assert stream.next_delivery(0).seq == 2 and stream.window_freed
    assert [t.seq for t in dispatch_all(stream)] == [4]
    stream.resolve(batch_delivery(3))
    stream.resolve(batch_delivery(4))
    assert stream.next_delivery(0).seq == 3 and stream.window_freed  # full, though nothing waits: a harmless wake
    assert stream.next_delivery(0).seq == 4 and not stream.window_freed  # one left in the window of 2
    assert stream.next_delivery(0) is END and not stream.window_freed


def test_a_skipped_batch_that_frees_the_window_returns_at_once_so_the_scheduler_hears_it() -> None:
    """A spent replica's position is skipped, not sent; taking it out of a full window must reach the scheduler
    before the servicer waits for the next batch, which is not dispatched until then."""
    stream = lone_stream(map_spec(window=1))
    stream.add_plan([(0,), (1,)], end=True)
    assert [t.seq for t in dispatch_all(stream)] == [0]
    stream.resolve(Delivery(seq=0))  # nothing to send: skipped
    started = time.monotonic()
    assert stream.next_delivery(5.0) is None and stream.window_freed
    assert time.monotonic() - started < 1.0, "it waited for a batch the scheduler was not told to make"
    assert [t.seq for t in dispatch_all(stream)] == [1]
    stream.resolve(batch_delivery(1))
    assert stream.next_delivery(0).seq == 1  # type: ignore[union-attr]


def test_a_duplicate_result_is_released_not_delivered() -> None:
    released: list[FinishedBatch] = []
    stream = lone_stream(map_spec(), released.append)
    stream.add_plan([(0,)], end=True)
    dispatch_all(stream)
    first, second = batch_delivery(0), batch_delivery(0)
    stream.resolve(first)
    stream.resolve(second)
    assert released == [second.batch]
    assert drain(stream) == [first, END]


def test_a_retried_task_goes_before_new_work() -> None:
    stream = lone_stream(map_spec(window=2))
    stream.add_plan([(0,), (1,), (2,)], end=True)
    first, second = dispatch_all(stream)
    stream.retry(second)
    stream.retry(first)
    assert stream.wants_dispatch(), "a retry is dispatched even with a full window"
    again = dispatch_all(stream)
    assert again[:2] == [first, second]


def test_an_error_takes_its_position() -> None:
    stream = lone_stream(map_spec())
    stream.add_plan([(0,), (1,)], end=True)
    dispatch_all(stream)
    stream.resolve(Delivery(seq=0, error=b"err"))
    stream.resolve(batch_delivery(1))
    assert [(d.seq, d.error) for d in drain(stream)] == [(0, b"err"), (1, None), (-1, None)]


def test_a_resumed_map_stream_starts_at_its_position() -> None:
    stream = lone_stream(map_spec(start=10))
    stream.add_plan([(5,)], end=True)
    (task,) = dispatch_all(stream)
    assert task.seq == 10 and stream.consumed == 10
    stream.resolve(batch_delivery(10))
    assert [d.seq for d in drain(stream)] == [10, -1]


def test_a_resumed_iterable_stream_replays_then_delivers() -> None:
    stream = lone_stream(iter_spec(replicas=1, window=4, start=2))
    tasks = dispatch_all(stream)
    assert [t.batch_index for t in tasks] == [0, 1, 2, 3], "replayed from the replica's start"
    for task in tasks:
        stream.resolve(batch_delivery(task.seq))
    deliveries = drain(stream)
    assert [d.replay for d in deliveries] == [True, True, False, False]
    assert stream.delivered == 2


def test_iterable_stream_with_a_spent_replica_skips_its_positions() -> None:
    released: list[FinishedBatch] = []
    stream = lone_stream(iter_spec(replicas=2, window=8), released.append)
    stream.progress(consumed=100, stalled_us=0)
    tasks = dispatch_all(stream)
    assert all(isinstance(t, IterTask) for t in tasks)
    r1 = [t for t in tasks if t.replica == 1]
    stream.resolve(Delivery(seq=r1[0].seq, exhausted=True))
    late = batch_delivery(r1[1].seq)
    stream.resolve(late)  # produced by the spent replica after it ran dry: torch drops it
    assert released == [late.batch]
    for task in tasks:
        if task.replica == 0:
            stream.resolve(batch_delivery(task.seq))
    for task in r1[2:]:
        stream.resolve(Delivery(seq=task.seq, exhausted=True))
    assert [d.seq for d in drain(stream)] == [t.seq for t in tasks if t.replica == 0]
    more = dispatch_all(stream)
    assert more and all(t.replica == 0 for t in more)


def test_next_delivery_waits_and_wakes_on_resolve() -> None:
    stream = lone_stream(map_spec())
    stream.add_plan([(0,)], end=True)
    dispatch_all(stream)
    assert stream.next_delivery(0.01) is None

    def later() -> None:
        time.sleep(0.05)
        with stream.cond:
            stream.resolve(batch_delivery(0))

    threading.Thread(target=later).start()
    assert stream.next_delivery(5.0).seq == 0


def test_failure_and_close() -> None:
    released: list[FinishedBatch] = []
    stream = lone_stream(map_spec(), released.append)
    stream.add_plan([(0,)], end=False)
    dispatch_all(stream)
    ready = batch_delivery(0)
    stream.resolve(ready)
    stream.fail(StreamFailed(FailReason.INVALID, "bad plan"))
    stream.fail(StreamFailed(FailReason.UNAVAILABLE, "later"))
    with pytest.raises(StreamFailed, match="bad plan"):
        stream.next_delivery(0)
    assert not stream.wants_dispatch()
    assert stream.close() is True and stream.close() is False
    assert released == [ready.batch], "what the stream still held goes back once"


def test_a_positioned_stream_seeds_each_batch_by_its_epoch_position_and_delivers_in_plan_order() -> None:
    """What lets a client spread an epoch over daemons: position 12 is seeded as position 12 anywhere."""
    import dataclasses

    from loaderd.server.scheduling.stream import fetch_task

    stream = lone_stream(dataclasses.replace(map_spec(window=8), positioned=True))
    stream.add_plan([(5,), (6,), (7,)], end=True, positions=[12, 3, 40])
    tasks = dispatch_all(stream)
    assert [(t.seq, t.position) for t in tasks] == [(0, 12), (1, 3), (2, 40)]
    for task, position in zip(tasks, (12, 3, 40)):
        assert task.seed == fetch_task(0, "m", position, task.indices, True, 7).seed  # a contiguous stream's seed there
    assert not stream.positions  # forgotten once dispatched
    for seq in (2, 0, 1):
        stream.resolve(batch_delivery(seq))
    assert [d.seq for d in drain(stream)] == [0, 1, 2, -1]


class _CountedCondition(threading.Condition):
    """A held condition (``held_lock``) that counts its ``notify_all`` calls: each wakes a waiting servicer."""

    def __init__(self) -> None:
        super().__init__(threading.RLock())
        self.woken = 0
        self.acquire()

    def notify_all(self) -> None:
        self.woken += 1
        super().notify_all()


def test_a_batch_wakes_the_servicer_only_when_it_is_the_one_it_waits_for() -> None:
    """Batches that come ahead of the next one in order change nothing the servicer waits on: with 2 workers one in
    three did, and each woke the servicer's thread for nothing."""
    cond = _CountedCondition()
    stream = lone_stream(map_spec(window=8), cond=cond)
    stream.add_plan([(0,), (1,), (2,)], end=True)
    woken_by_plan = cond.woken
    dispatch_all(stream)
    stream.resolve(batch_delivery(2))
    stream.resolve(batch_delivery(1))
    assert cond.woken == woken_by_plan
    assert stream.next_delivery(0) is None
    stream.resolve(batch_delivery(0))
    assert cond.woken == woken_by_plan + 1
    assert [stream.next_delivery(0).seq for _ in range(3)] == [0, 1, 2]  # type: ignore[union-attr]
    assert stream.next_delivery(0) is END


def test_a_plan_wakes_the_servicer_only_with_its_end() -> None:
    """A plan's batches are the scheduler's to make (it is woken for them); the servicer waits for a batch or the
    stream's end, so only the plan's end may change what it waits for."""
    cond = _CountedCondition()
    stream = lone_stream(map_spec(window=8), cond=cond)
    stream.add_plan([(0,), (1,)], end=False)
    stream.progress(1, 0)
    stream.add_plan([], end=False)  # progress alone
    assert cond.woken == 0
    dispatch_all(stream)
    stream.resolve(batch_delivery(0))
    stream.resolve(batch_delivery(1))
    assert cond.woken == 1  # batch 1 came ahead of the one the servicer takes next (batch 0 was there)
    assert [d.seq for d in (stream.next_delivery(0), stream.next_delivery(0))] == [0, 1]
    assert stream.next_delivery(0) is None  # no end yet: not finished
    stream.add_plan([], end=True)
    assert cond.woken == 2
    assert stream.next_delivery(0) is END
