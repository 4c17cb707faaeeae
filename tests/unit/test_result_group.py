"""A worker's results several to a write (server/worker/result_group.py): the group on a real pipe, and a real
BatchMaker holding a batch's result only while its next task is a grouped one already in its pipe."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from loaderd.server.config.schema import DatasetSpec, LoaderConfig
from loaderd.server.shm.arena import INLINE_BYTES
from loaderd.server.worker import batches as batches_module
from loaderd.server.worker.batches import BatchMaker
from loaderd.server.worker.datasets import build_dataset
from loaderd.server.worker.entry import WorkerSpec
from loaderd.server.worker.result_group import ResultGroup
from loaderd.server.worker.tasks import BatchDone, BatchFailed, FetchTask, ReplicaExhausted, Task

pytestmark = pytest.mark.timeout(10)


@pytest.fixture(autouse=True)
def quick_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch here counts as quick: a loaded machine may take over ``HOLD_BELOW_S`` for a first batch."""
    monkeypatch.setattr(batches_module, "HOLD_BELOW_S", 60.0)


def received(reader: Connection) -> list[Any]:
    """What the pipe holds now, read as the daemon reads it (``Connection.recv``)."""
    got = []
    while reader.poll(0):
        got.append(reader.recv())
    return got


def exhausted(seq: int) -> ReplicaExhausted:
    return ReplicaExhausted(stream_id=1, seq=seq)


def test_held_results_go_in_order_with_the_first_one_not_held(results: tuple[Connection, Connection]) -> None:
    reader, writer = results
    group = ResultGroup(writer, size=4)
    group.send(exhausted(0), hold=True)
    group.send(exhausted(1), hold=True)
    assert group.held == 2 and received(reader) == [], "nothing written while held"
    group.send(exhausted(2))
    assert group.held == 0 and received(reader) == [exhausted(0), exhausted(1), exhausted(2)]


def test_a_full_group_is_written_even_if_asked_to_hold(results: tuple[Connection, Connection]) -> None:
    reader, writer = results
    group = ResultGroup(writer, size=3)
    for seq in range(7):
        group.send(exhausted(seq), hold=True)
    assert [r.seq for r in received(reader)] == [0, 1, 2, 3, 4, 5], "two writes of three"
    assert group.held == 1
    group.flush()
    group.flush()  # nothing held: nothing written
    assert [r.seq for r in received(reader)] == [6]


def test_a_result_with_a_payload_is_never_held_and_a_large_one_goes_after_its_write(results: tuple[Connection, Connection]) -> None:
    reader, writer = results
    group = ResultGroup(writer)
    group.send(exhausted(0), hold=True)
    group.send(exhausted(1), hold=True, payload=[memoryview(b"ab"), memoryview(b"cde")])
    assert group.held == 0, "a small batch's arrays go at once, with what was held"
    assert [reader.recv(), reader.recv(), reader.recv_bytes(), reader.recv_bytes()] == [exhausted(0), exhausted(1), b"ab", b"cde"]
    assert not reader.poll(0)
    group.send(exhausted(2), hold=True)
    large = memoryview(bytes(INLINE_BYTES + 1))
    sender = threading.Thread(target=group.send, args=(exhausted(3),), kwargs={"hold": True, "payload": [large]})
    sender.start()  # more than the pipe holds: read while written
    got = [reader.recv(), reader.recv(), reader.recv_bytes()]
    sender.join(5)
    assert got == [exhausted(2), exhausted(3), large.tobytes()], "held first, in order; the large one after"
    assert group.held == 0 and not reader.poll(0)


def maker(results: Connection, queued: list[Task]) -> BatchMaker:
    """A BatchMaker over ``support.datasets:Failing`` (a batch of one index is a plain int: no payload follows its
    BatchDone; index 5 raises), no shared memory; ``queued[0]`` is the task its pipe holds next."""
    spec = DatasetSpec(name="d", factory="support.datasets:Failing", kwargs={"n": 100, "bad": (5,)})
    config = LoaderConfig(path=Path("test.yaml"), listen=(), workers=1, python_path=(), datasets={"d": spec})
    worker = WorkerSpec(worker_id=0, pool_size=1, config=config, tasks=results, results=results, shm_prefix=None, shm_cap_bytes=0)
    return BatchMaker(worker, {"d": build_dataset(spec)}, ahead=lambda: queued[0] if queued else None)


def fetch(seq: int, grouped: bool = True) -> FetchTask:
    return FetchTask(stream_id=1, seq=seq, dataset="d", indices=seq, auto_collation=False, seed=seq, grouped=grouped)


def run(batches: BatchMaker, queued: list[Task]) -> None:
    """Run the queued tasks in order, each seeing the rest as its pipe's next."""
    while queued:
        task = queued.pop(0)
        assert isinstance(task, FetchTask)
        batches.fetch(task)


def test_a_worker_holds_results_while_a_grouped_task_is_next(results: tuple[Connection, Connection]) -> None:
    reader, writer = results
    queued: list[Task] = [fetch(seq) for seq in range(10, 16)]
    batches = maker(writer, queued)
    batches.fetch(queued.pop(0))
    batches.fetch(queued.pop(0))
    assert received(reader) == [] and batches.results.held == 2
    run(batches, queued)
    got = received(reader)
    assert [r.seq for r in got] == list(range(10, 16)) and all(isinstance(r, BatchDone) for r in got)
    assert batches.results.held == 0, "the last has no task after it: nothing stays held"
    # Each says how long it took to make (the daemon's clock sees a group's results arrive together).
    assert all(r.made_s is not None and 0 <= r.made_s < 1 for r in got)


def test_a_small_batch_goes_at_once_with_its_arrays(results: tuple[Connection, Connection]) -> None:
    """No shared memory here: a collated batch's tensor goes on the pipe after its result, in the same write, and is
    never held (held, a client on several daemons took it for late: server/worker/batches.py)."""
    reader, writer = results
    queued: list[Task] = [
        FetchTask(stream_id=1, seq=seq, dataset="d", indices=(seq, seq + 10), auto_collation=True, seed=seq, grouped=True)
        for seq in range(3)
    ]
    batches = maker(writer, queued)
    got = []
    for _ in range(2):
        batches.fetch(queued.pop(0))
        assert batches.results.held == 0
        done = reader.recv()
        got.append((done.seq, [reader.recv_bytes() for _ in done.buffer_offsets]))
        assert not reader.poll(0)
    assert [(seq, [list(memoryview(raw).cast("q")) for raw in raws]) for seq, raws in got] == [(0, [[0, 10]]), (1, [[1, 11]])]


@pytest.mark.parametrize("following", ["none", "ungrouped"])
def test_a_result_goes_at_once_unless_a_grouped_task_follows(results: tuple[Connection, Connection], following: str) -> None:
    reader, writer = results
    queued: list[Task] = [fetch(0)] + ([fetch(1, grouped=False)] if following == "ungrouped" else [])
    batches = maker(writer, queued)
    batches.fetch(queued.pop(0))
    assert [r.seq for r in received(reader)] == [0]


def test_an_ungrouped_task_s_result_is_never_held(results: tuple[Connection, Connection]) -> None:
    reader, writer = results
    queued: list[Task] = [fetch(0, grouped=False), fetch(1)]
    batches = maker(writer, queued)
    batches.fetch(queued.pop(0))
    assert [r.seq for r in received(reader)] == [0]


def test_a_failure_goes_after_the_results_held(results: tuple[Connection, Connection]) -> None:
    reader, writer = results
    queued: list[Task] = [fetch(seq) for seq in range(3, 7)]  # index 5 raises
    batches = maker(writer, queued)
    batches.fetch(queued.pop(0))
    batches.fetch(queued.pop(0))
    assert received(reader) == [] and batches.results.held == 2
    batches.fetch(queued.pop(0))
    got = received(reader)
    assert [(type(r), r.seq) for r in got] == [(BatchDone, 3), (BatchDone, 4), (BatchFailed, 5)]


def test_a_result_goes_at_once_when_another_dataset_s_task_follows(results: tuple[Connection, Connection]) -> None:
    """Another dataset's batch may take any time: a quick one's result does not wait for it."""
    reader, writer = results
    other = FetchTask(stream_id=2, seq=0, dataset="e", indices=0, auto_collation=False, seed=0, grouped=True)
    queued: list[Task] = [fetch(0), other]
    batches = maker(writer, queued)
    batches.fetch(queued.pop(0))
    assert [r.seq for r in received(reader)] == [0]


def test_a_slow_batch_s_result_goes_at_once(results: tuple[Connection, Connection], monkeypatch: pytest.MonkeyPatch) -> None:
    reader, writer = results
    monkeypatch.setattr(batches_module, "HOLD_BELOW_S", 0.0)  # every batch takes longer than that
    queued: list[Task] = [fetch(0), fetch(1)]
    batches = maker(writer, queued)
    batches.fetch(queued.pop(0))
    assert [r.seq for r in received(reader)] == [0]
