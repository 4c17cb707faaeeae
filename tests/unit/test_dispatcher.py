"""The dispatcher against fake producers: round-robin, per-worker queues, pinned work, deaths and blame.

No scheduler, no pool: each test says which workers accept work and reads what was submitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from loaderd.server.scheduling.dispatcher import MAX_ATTEMPTS, PER_WORKER, Dispatcher
from loaderd.server.scheduling.producer import Delivery, WorkerSlots
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


def run(dispatcher: Dispatcher, ready: list[int]) -> list[tuple[int, Task]]:
    sent: list[tuple[int, Task]] = []
    dispatcher.dispatch(ready, SLOTS, lambda worker, task: sent.append((worker, task)))
    return sent


def test_each_worker_gets_its_queue_and_producers_take_turns() -> None:
    dispatcher = Dispatcher(2)
    a, b = FakeProducer(1, 10), FakeProducer(2, 10)
    dispatcher.add(a)
    dispatcher.add(b)
    sent = run(dispatcher, [0, 1])
    assert sorted(w for w, _ in sent) == [0, 0, 1, 1] and len(sent) == 2 * PER_WORKER
    assert sorted(t.stream_id for _, t in sent) == [1, 1, 2, 2]
    assert run(dispatcher, [0, 1]) == [], "every queue is full until a worker answers"
    assert dispatcher.busy() == {0: PER_WORKER, 1: PER_WORKER}


def test_pinned_work_waits_for_its_worker() -> None:
    dispatcher = Dispatcher(2)
    dispatcher.add(FakeProducer(1, 5, pinned=1))
    assert run(dispatcher, [0]) == []
    assert [w for w, _ in run(dispatcher, [0, 1])] == [1] * PER_WORKER


def test_an_answer_frees_room_and_starts_the_next_task() -> None:
    dispatcher = Dispatcher(1)
    producer = FakeProducer(1, 5)
    dispatcher.add(producer)
    first, second = (task for _, task in run(dispatcher, [0]))
    assert [r.started_at is not None for _, _, r in dispatcher.running()] == [True]
    record = dispatcher.answered(0, (1, first.seq))
    assert record is not None and record.task is first
    [(worker, key, head)] = dispatcher.running()
    assert (worker, key, head.task) == (0, (1, second.seq), second) and head.started_at is not None
    assert dispatcher.answered(0, (1, first.seq)) is None, "a second answer finds nothing"
    assert [task.seq for _, task in run(dispatcher, [0])] == [2]


def test_a_death_blames_only_the_running_task_and_requeues_all() -> None:
    dispatcher = Dispatcher(1)
    producer = FakeProducer(1, 5)
    dispatcher.add(producer)
    running, queued = (task for _, task in run(dispatcher, [0]))
    assert dispatcher.worker_lost(0, blame_running=True) == []
    assert producer.retried == [running, queued]
    assert (dispatcher.attempts((1, running.seq)), dispatcher.attempts((1, queued.seq))) == (1, 0)
    assert dispatcher.idle(0)


def test_a_death_the_daemon_caused_blames_nothing() -> None:
    dispatcher = Dispatcher(1)
    producer = FakeProducer(1, 5)
    dispatcher.add(producer)
    running, _ = (task for _, task in run(dispatcher, [0]))
    dispatcher.worker_lost(0, blame_running=False)
    assert dispatcher.attempts((1, running.seq)) == 0 and producer.retried[0] is running


def test_a_task_that_keeps_killing_workers_is_handed_back_to_be_failed() -> None:
    dispatcher = Dispatcher(1)
    producer = FakeProducer(1, 1)
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
