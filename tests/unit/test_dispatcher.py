"""The dispatcher against fake producers: round-robin, per-worker queues, pinned work, deaths and blame.

No scheduler, no pool: each test says which workers accept work and reads what was submitted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
from support.fakes import FakeClock

from loaderd.server.scheduling.dispatcher import GROUPED_PER_WORKER, MAX_ATTEMPTS, PER_WORKER, Dispatcher
from loaderd.server.scheduling.producer import Delivery, WorkerSlots
from loaderd.server.worker.result_group import HOLD_BELOW_S
from loaderd.server.worker.tasks import BatchTask, FetchTask, Task

pytestmark = pytest.mark.timeout(10)

SLOTS = WorkerSlots(2)


@dataclass
class FakeProducer:
    """Tasks 0..n-1 of one producer, optionally pinned to a worker; records what the dispatcher did."""

    producer_id: int
    n: int
    pinned: int | None = None
    next_seq: int = 0
    retried: list[BatchTask] = field(default_factory=list)
    resolved: list[Delivery] = field(default_factory=list)

    def task(self, seq: int) -> FetchTask:
        return FetchTask(stream_id=self.producer_id, dataset="m", seq=seq, indices=(seq,), auto_collation=True, seed=0)

    def wants_dispatch(self) -> bool:
        return bool(self.retried) or self.next_seq < self.n

    def next_task(self, slots: WorkerSlots) -> tuple[BatchTask, int | None]:
        return (self.retried[0] if self.retried else self.task(self.next_seq)), self.pinned

    def commit(self, task: BatchTask) -> None:
        if self.retried and task is self.retried[0]:
            self.retried.pop(0)
        else:
            self.next_seq += 1

    def retry(self, task: BatchTask) -> None:
        self.retried.append(task)

    def resolve(self, delivery: Delivery) -> None:
        self.resolved.append(delivery)

    def queued(self) -> int:
        return self.n - self.next_seq


@dataclass
class TimedProducer(FakeProducer):
    """Tasks of dataset ``t`` (a dataset with a ``task_timeout`` in these tests)."""

    def task(self, seq: int) -> FetchTask:
        return FetchTask(stream_id=self.producer_id, dataset="t", seq=seq, indices=(seq,), auto_collation=True, seed=0)


def run(dispatcher: Dispatcher, ready: list[int]) -> list[tuple[int, Task]]:
    sent: list[tuple[int, Task]] = []
    dispatcher.dispatch(ready, SLOTS, lambda worker, task: sent.append((worker, task)))
    return sent


def quick(dispatcher: Dispatcher, worker: int = 0) -> Dispatcher:
    """``dispatcher`` once a task of dataset ``m`` came back from ``worker`` at once: its tasks are quick."""
    dispatcher.add(FakeProducer(99, 1))
    [(_, task)] = run(dispatcher, [worker])
    dispatcher.answered(worker, (99, task.seq))
    dispatcher.remove(99)
    return dispatcher


def test_each_worker_gets_its_queue_and_producers_take_turns() -> None:
    dispatcher = Dispatcher(2)
    a, b = FakeProducer(1, 10), FakeProducer(2, 10)
    dispatcher.add(a)
    dispatcher.add(b)
    sent = run(dispatcher, [0, 1])
    assert sorted(w for w, _ in sent) == [0] * PER_WORKER + [1] * PER_WORKER
    assert sorted(t.stream_id for _, t in sent) == [1] * PER_WORKER + [2] * PER_WORKER
    assert run(dispatcher, [0, 1]) == [], "every queue is full until a worker answers"
    assert dispatcher.busy() == {0: PER_WORKER, 1: PER_WORKER}


def test_pinned_work_waits_for_its_worker() -> None:
    dispatcher = Dispatcher(2)
    dispatcher.add(FakeProducer(1, 5, pinned=1))
    assert run(dispatcher, [0]) == []
    assert [w for w, _ in run(dispatcher, [0, 1])] == [1] * PER_WORKER


def test_an_answer_frees_room_and_starts_the_next_task() -> None:
    dispatcher = Dispatcher(1)
    producer = FakeProducer(1, 2 * PER_WORKER)
    dispatcher.add(producer)
    first, second, *_ = (task for _, task in run(dispatcher, [0]))
    assert [r.started_at is not None for _, _, r in dispatcher.running()] == [True]
    record = dispatcher.answered(0, (1, first.seq))
    assert record is not None and record.task is first
    [(worker, key, head)] = dispatcher.running()
    assert (worker, key, head.task) == (0, (1, second.seq), second) and head.started_at is not None
    assert dispatcher.answered(0, (1, first.seq)) is None, "a second answer finds nothing"
    # The dataset's tasks are quick now (the first came back at once): the next ones go grouped, and queue deeper.
    assert [(t.seq, t.grouped) for _, t in run(dispatcher, [0])] == [(seq, True) for seq in range(PER_WORKER, 2 * PER_WORKER)]


def test_a_death_blames_only_the_running_task_and_requeues_all() -> None:
    dispatcher = Dispatcher(1, timed={"m"})  # a dataset with a task_timeout: its tasks never go grouped
    producer = FakeProducer(1, 5)
    dispatcher.add(producer)
    running, queued, *rest = (task for _, task in run(dispatcher, [0]))
    assert not running.grouped and not queued.grouped
    assert dispatcher.worker_lost(0, blame_running=True) == []
    assert producer.retried == [running, queued, *rest]
    assert (dispatcher.attempts((1, running.seq)), dispatcher.attempts((1, queued.seq))) == (1, 0)
    assert dispatcher.idle(0)


def test_a_death_the_daemon_caused_blames_nothing() -> None:
    dispatcher = Dispatcher(1)
    producer = FakeProducer(1, 5)
    dispatcher.add(producer)
    running, *_ = (task for _, task in run(dispatcher, [0]))
    dispatcher.worker_lost(0, blame_running=False)
    assert dispatcher.attempts((1, running.seq)) == 0 and producer.retried[0] is running


def test_a_quick_dataset_s_tasks_go_grouped_and_queue_deeper() -> None:
    dispatcher = Dispatcher(2)
    dispatcher.add(FakeProducer(1, 20))
    assert [(w, t.grouped) for w, t in run(dispatcher, [0, 1])] == [(0, False), (1, False)] * PER_WORKER, "not known yet"
    assert dispatcher.made("m") is None
    quick(Dispatcher(1))  # (another dispatcher: this one's workers are full)
    dispatcher = quick(Dispatcher(2))
    dispatcher.add(FakeProducer(1, 20))
    sent = run(dispatcher, [0, 1])
    assert len(sent) == 2 * GROUPED_PER_WORKER and all(isinstance(t, FetchTask) and t.grouped for _, t in sent)
    assert dispatcher.busy() == {0: GROUPED_PER_WORKER, 1: GROUPED_PER_WORKER}


def test_a_slow_dataset_s_tasks_stay_ungrouped() -> None:
    dispatcher = Dispatcher(1)
    dispatcher.add(FakeProducer(1, 20))
    run(dispatcher, [0])
    for _ in range(PER_WORKER):
        [(worker, key, head)] = dispatcher.running()
        head.started_at = time.monotonic() - 2 * HOLD_BELOW_S  # it ran that long
        dispatcher.answered(worker, key)
    made = dispatcher.made("m")
    assert made is not None and made >= 2 * HOLD_BELOW_S
    assert [t.grouped for _, t in run(dispatcher, [0])] == [False] * PER_WORKER


def test_a_dataset_s_quickness_is_what_its_worker_timed_not_when_a_group_arrived() -> None:
    """Batches of 25 ms answered four at once: by the daemon's clock the first took 0.1 s and the others none (a
    mean ~30% low: 17 ms, quick); by the worker's own times, 25 ms each: not quick."""
    dispatcher = quick(Dispatcher(1))
    dispatcher.add(FakeProducer(1, 200))
    for _ in range(10):
        for worker, task in run(dispatcher, [0]):
            dispatcher.answered(worker, (task.stream_id, task.seq), made_s=1.25 * HOLD_BELOW_S)
    made = dispatcher.made("m")
    assert made is not None and made == pytest.approx(1.25 * HOLD_BELOW_S, rel=0.05)
    assert [t.grouped for _, t in run(dispatcher, [0])] == [False] * PER_WORKER


def test_map_style_tasks_go_grouped_and_a_death_under_one_blames_none() -> None:
    dispatcher = quick(Dispatcher(1))
    producer = FakeProducer(1, 2)
    dispatcher.add(producer)
    first = [task for _, task in run(dispatcher, [0])]
    assert all(isinstance(t, FetchTask) and t.grouped for t in first)
    # The worker may have finished the first and held its result: nobody is blamed, both run again ungrouped.
    assert dispatcher.worker_lost(0, blame_running=True) == []
    assert [t.seq for t in producer.retried] == [0, 1] and [dispatcher.attempts((1, t.seq)) for t in first] == [0, 0]
    again = [task for _, task in run(dispatcher, [0])]
    assert [(t.seq, t.grouped) for t in again] == [(0, False), (1, False)]
    # Ungrouped, the first is the running one: the next death blames it alone.
    assert dispatcher.worker_lost(0, blame_running=True) == []
    assert [dispatcher.attempts((1, t.seq)) for t in first] == [1, 0]
    again = [task for _, task in run(dispatcher, [0])]
    dispatcher.answered(0, (1, again[0].seq))
    dispatcher.answered(0, (1, again[1].seq))
    producer.n = 4
    assert [(t.seq, t.grouped) for _, t in run(dispatcher, [0])] == [(2, True), (3, True)], "new work goes grouped"


def test_a_death_the_daemon_caused_leaves_tasks_grouped() -> None:
    dispatcher = quick(Dispatcher(1))
    producer = FakeProducer(1, 2)
    dispatcher.add(producer)
    run(dispatcher, [0])
    dispatcher.worker_lost(0, blame_running=False)
    assert [(t.seq, t.grouped) for _, t in run(dispatcher, [0])] == [(0, True), (1, True)]


def test_a_death_with_an_ungrouped_task_second_blames_the_first() -> None:
    """The worker holds a result only while a grouped task follows it: with an ungrouped one next, the first ran."""
    dispatcher = quick(Dispatcher(1, timed={"t"}))
    dispatcher.add(FakeProducer(1, 1))
    dispatcher.add(TimedProducer(2, 1))
    sent = [task for _, task in run(dispatcher, [0])]
    assert [(t.stream_id, t.grouped) for t in sent] == [(2, False), (1, True)]
    dispatcher.worker_lost(0, blame_running=True)
    assert (dispatcher.attempts((2, 0)), dispatcher.attempts((1, 0))) == (1, 0)


def test_a_task_that_keeps_killing_workers_is_handed_back_to_be_failed() -> None:
    dispatcher = Dispatcher(1)
    producer = FakeProducer(1, 1)  # one task: grouped, but alone in its worker, so it was the one running
    dispatcher.add(producer)
    for attempt in range(1, MAX_ATTEMPTS + 1):
        [(_, task)] = run(dispatcher, [0])
        spent = dispatcher.worker_lost(0, blame_running=True)
        if attempt < MAX_ATTEMPTS:
            assert spent == [] and producer.retried == [task]
    assert [(s.producer, s.task.seq, s.attempts) for s in spent] == [(producer, 0, MAX_ATTEMPTS)]
    assert producer.retried == [] and dispatcher.attempts((1, 0)) == 0


def test_a_removed_producer_gets_nothing_back() -> None:
    dispatcher = Dispatcher(1)
    producer = FakeProducer(1, 5)
    dispatcher.add(producer)
    run(dispatcher, [0])
    dispatcher.remove(1)
    assert dispatcher.producer(1) is None
    assert dispatcher.worker_lost(0, blame_running=True) == [] and producer.retried == []


def test_workers_queueing_grouped_tasks_past_per_worker_count_as_starved() -> None:
    """Grouped tasks queue up to GROUPED_PER_WORKER a worker, so a stream's whole window may sit in the workers with
    nothing waiting outside: a pool whose workers hold more than PER_WORKER each is behind all the same (an
    elastic pool grows on it). One holding PER_WORKER each with nothing more to do is not."""
    clock = FakeClock()
    dispatcher = quick(Dispatcher(4, clock))
    dispatcher.add(FakeProducer(1, 16))
    assert len(run(dispatcher, [0, 1, 2, 3])) == 16 and dispatcher.busy() == {0: 4, 1: 4, 2: 4, 3: 4}
    clock.now += 1.0
    assert dispatcher.clocks()[1] == 1.0

    clock = FakeClock()
    dispatcher = Dispatcher(4, clock)  # the dataset's speed not known: ungrouped, PER_WORKER each
    dispatcher.add(FakeProducer(1, 4 * PER_WORKER))
    assert dispatcher.busy() == {} and len(run(dispatcher, [0, 1, 2, 3])) == 4 * PER_WORKER
    clock.now += 1.0
    assert dispatcher.clocks()[1] == 0.0


def test_grouped_work_goes_no_deeper_while_an_ungrouped_task_waits() -> None:
    """A quick stream's groups fill a worker past PER_WORKER only once no ungrouped task (a slow or timed stream's,
    an iterable replica's) wants in: otherwise the round-robin share of that stream is kept."""
    dispatcher = quick(Dispatcher(1, timed={"t"}))
    dispatcher.add(FakeProducer(1, 20))
    dispatcher.add(TimedProducer(2, 20))
    sent = run(dispatcher, [0])
    assert dispatcher.busy() == {0: PER_WORKER} and {t.stream_id for _, t in sent} == {1, 2}
    assert run(dispatcher, [0]) == [], "still full for the ungrouped one: no deeper"

    dispatcher = quick(Dispatcher(1, timed={"t"}))
    dispatcher.add(FakeProducer(1, 20))
    dispatcher.add(TimedProducer(2, 1))  # one task, then nothing waits
    run(dispatcher, [0])
    assert dispatcher.busy() == {0: GROUPED_PER_WORKER}


def test_no_task_goes_grouped_without_groups() -> None:
    """An elastic pool's dispatcher (the scheduler's choice): quick or not, every task is ungrouped, PER_WORKER deep."""
    dispatcher = quick(Dispatcher(1, groups=False))
    dispatcher.add(FakeProducer(1, 20))
    assert [t.grouped for _, t in run(dispatcher, [0])] == [False] * PER_WORKER
