"""A worker with item threads starts the next batch's items while it finishes one (BatchMaker._run_ahead,
server/worker/batches.py): a real BatchMaker and dataset, the task it takes next given as ``TaskInbox.peek`` gives it,
its results read from a real pipe."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from loaderd.server.config.schema import DatasetSpec, LoaderConfig
from loaderd.server.pool.task_pipe import TaskPipe
from loaderd.server.worker.batches import BatchMaker
from loaderd.server.worker.datasets import build_dataset
from loaderd.server.worker.entry import WorkerSpec
from loaderd.server.worker.task_inbox import TaskInbox
from loaderd.server.worker.tasks import BatchDone, BatchFailed, FetchTask, Task
from loaderd.server.worker.thread_sizer import ThreadSizer

pytestmark = pytest.mark.timeout(30)


def fetch(seq: int, indices: tuple[int, ...], dataset: str = "d") -> FetchTask:
    return FetchTask(stream_id=1, seq=seq, dataset=dataset, indices=indices, auto_collation=True, seed=1000 + seq)


def maker(results: Connection, ahead: Callable[[], Task | None], **dataset: Any) -> BatchMaker:
    """A BatchMaker over one dataset ``d`` (support.datasets:CrossBatch); ``ahead`` says the task it takes next."""
    spec = DatasetSpec(name="d", factory="support.datasets:CrossBatch", **dataset)
    config = LoaderConfig(path=Path("test.yaml"), listen=(), workers=1, python_path=(), datasets={"d": spec})
    worker = WorkerSpec(worker_id=0, pool_size=1, config=config, tasks=results, results=results, shm_prefix=None, shm_cap_bytes=0)
    return BatchMaker(worker, {"d": build_dataset(spec)}, ahead=ahead)


def next_of(queued: list[Task]) -> Callable[[], Task | None]:
    """What the pipe holds next: ``queued[0]``, if any."""
    return lambda: queued[0] if queued else None


def received(reader: Connection) -> list[Any]:
    """The results sent so far (a BatchDone's buffers read past)."""
    got = []
    while reader.poll(0):
        result = pickle.loads(reader.recv_bytes())
        got.append(result)
        if isinstance(result, BatchDone):
            for _ in result.buffer_offsets:
                reader.recv_bytes()
    return got


def test_the_next_batch_s_items_start_while_this_one_finishes(pipe: tuple[Connection, TaskPipe], results: tuple[Connection, Connection]) -> None:
    """Item 0 of the first batch waits for item 100 of the second: with threads it gets through. Each item is made
    once, every item of the first batch taken before the second started sees the first's seed, the second's its own.
    The tasks come as the daemon sends them, through a real TaskInbox."""
    tasks_in, tasks = pipe
    reader, writer = results
    first, second = fetch(0, tuple(range(12))), fetch(1, (100, 101, 102))
    tasks.send(first)
    tasks.send(second)
    inbox = TaskInbox(tasks_in)
    batches = maker(writer, inbox.peek, threads=3, kwargs={"n": 200, "hold": 0, "until": 100})
    try:
        for _ in range(2):
            task = inbox.take()
            assert isinstance(task, FetchTask)
            batches.fetch(task)
        got = received(reader)
    finally:
        batches.close(unlink=False)
    assert [type(r) for r in got] == [BatchDone, BatchDone]
    assert [r.seq for r in got] == [0, 1]
    seeds = batches.datasets["d"].dataset.seeds
    assert {i: len(s) for i, s in seeds.items()} == {i: 1 for i in (*range(12), 100, 101, 102)}  # not made again
    # The next batch is seeded once every item of this one is taken: only items still between being taken and
    # reading their worker info then (at most one per thread) may see its seed.
    assert sum(seeds[i][0] != first.seed for i in range(12)) <= 3
    assert {seeds[i][0] for i in (100, 101, 102)} == {second.seed}


def test_the_pipe_is_looked_at_once_every_item_is_taken_and_the_next_batch_is_made_before_its_turn(
    results: tuple[Connection, Connection],
) -> None:
    """The daemon queues a worker's next task when its batch before returns, so the worker looks once every item of
    its batch is taken (when its threads turn free), once per batch; the helpers then make that task's items."""
    reader, writer = results
    second = fetch(1, (10, 11, 12))
    looks: list[int] = []

    def ahead() -> Task | None:
        looks.append(1)
        return second if len(looks) == 1 else None  # the task loop takes it after that

    batches = maker(writer, ahead, threads=3, kwargs={"hold": -1})  # no item waits
    made = batches.datasets["d"].dataset.seeds
    try:
        batches.fetch(fetch(0, (0, 1, 2)))
        deadline = time.monotonic() + 10
        while not all(made.get(i) for i in (10, 11, 12)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(made[i] == [second.seed] for i in (10, 11, 12))  # made before its turn
        batches.fetch(second)
        got = received(reader)
        assert [type(r) for r in got] == [BatchDone, BatchDone] and [r.seq for r in got] == [0, 1]
        assert all(len(made[i]) == 1 for i in (10, 11, 12))
        assert len(looks) == 2  # one look per batch
    finally:
        batches.close(unlink=False)


def test_without_a_next_task_in_the_pipe_nothing_runs_ahead(results: tuple[Connection, Connection]) -> None:
    """The same batch alone: item 10 never starts, so item 0's wait fails its batch (as data), and the worker's
    next batch is unaffected."""
    reader, writer = results
    batches = maker(writer, next_of([]), threads=3, kwargs={"hold": 0, "until": 10, "timeout": 0.3})
    try:
        batches.fetch(fetch(0, (0, 1, 2)))
        batches.fetch(fetch(1, (3, 4)))
        got = received(reader)
    finally:
        batches.close(unlink=False)
    assert [type(r) for r in got] == [BatchFailed, BatchDone]


def test_one_thread_never_runs_ahead(results: tuple[Connection, Connection]) -> None:
    """With one thread a batch's items are made in the worker's own thread, in order, as torch's worker makes them."""
    reader, writer = results
    queued: list[Task] = [fetch(1, (10, 11))]
    batches = maker(writer, next_of(queued), kwargs={"hold": 0, "until": 10, "timeout": 0.3})
    try:
        batches.fetch(fetch(0, (0, 1)))
        got = received(reader)
    finally:
        batches.close(unlink=False)
    assert [type(r) for r in got] == [BatchFailed]
    assert 10 not in batches.datasets["d"].dataset.seeds


def test_a_started_batch_that_is_not_the_next_taken_is_dropped_not_made_twice(
    results: tuple[Connection, Connection], caplog: pytest.LogCaptureFixture
) -> None:
    """The inbox hands tasks over in order, so this is a bug's path: the batch that came is made in its turn, the one
    started ahead is cancelled, and the worker says so."""
    reader, writer = results
    queued: list[Task] = [fetch(1, (10, 11))]
    batches = maker(writer, next_of(queued), threads=2, kwargs={"hold": -1})
    try:
        batches.fetch(fetch(0, (0, 1)))
        queued.clear()
        with caplog.at_level("WARNING", logger="loaderd.worker"):
            batches.fetch(fetch(2, (20, 21)))
        got = received(reader)
    finally:
        batches.close(unlink=False)
    assert [(type(r), r.seq) for r in got] == [(BatchDone, 0), (BatchDone, 2)]
    assert "batch 1's items were started ahead, but batch 2 came first" in caplog.text
    seeds = batches.datasets["d"].dataset.seeds
    assert len(seeds[20]) == len(seeds[21]) == 1 and len(seeds.get(10, [])) <= 1 and len(seeds.get(11, [])) <= 1


class _BrokenSizer(ThreadSizer):
    def record(self, items: int, seconds: float) -> int | None:
        raise RuntimeError("sizer bug")


def test_a_failure_while_sizing_threads_auto_is_logged_and_the_batch_answered_once(
    results: tuple[Connection, Connection], caplog: pytest.LogCaptureFixture
) -> None:
    """threads: auto sizes after the batch went out (server/worker/batches.py _sized): a failure there must not
    answer the same batch a second time (as a BatchFailed)."""
    reader, writer = results
    batches = maker(writer, lambda: None, threads="auto")
    ds = batches.datasets["d"]
    assert ds.sizer is not None
    broken = dataclasses.replace(ds, sizer=_BrokenSizer())
    batches.datasets["d"] = broken
    with caplog.at_level(logging.ERROR, logger="loaderd.worker"):
        batches.fetch(fetch(0, (1, 2, 3)))
    got = received(reader)
    assert [type(r).__name__ for r in got] == ["BatchDone"] and got[0].seq == 0
    assert "sizing dataset 'd''s item threads failed" in caplog.text and "sizer bug" in caplog.text
    batches.close(unlink=False)
