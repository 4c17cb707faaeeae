"""SharedJob alone: each position once, fan-out with slot references, the bounded buffer."""

from __future__ import annotations

import pytest
from support.fakes import batch_delivery, drain, held_lock, lone_stream, map_spec

from loaderd.server.scheduling.ledger import FinishedBatch
from loaderd.server.scheduling.producer import Delivery, StreamFailed, WorkerSlots
from loaderd.server.scheduling.share import SharedJob, ShareKey, ShareMismatchError

pytestmark = pytest.mark.timeout(10)

KEY = ShareKey(name="s", epoch=0, dataset="m", fingerprint="fp", auto_collation=True, base_seed=7)


class Refs:
    """Counts retain/release per batch, as the ledger would."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}

    def retain(self, batch: FinishedBatch) -> None:
        self.count[batch.done.seq] = self.count.get(batch.done.seq, 1) + 1

    def release(self, batch: FinishedBatch) -> None:
        self.count[batch.done.seq] = self.count.get(batch.done.seq, 1) - 1


def job_with(consumers: int, buffer_limit: int = 4) -> tuple[SharedJob, list, Refs]:
    refs = Refs()
    job = SharedJob(job_id=99, key=KEY, buffer_limit=buffer_limit, retain=refs.retain, release=refs.release)
    streams = []
    cond = held_lock()  # one lock for the job and its consumers, as the scheduler's
    for i in range(consumers):
        stream = lone_stream(map_spec(window=64), refs.release, stream_id=i + 1, upstream=job, cond=cond)
        job.attach(stream)
        streams.append(stream)
    return job, streams, refs


def run(job: SharedJob) -> list[int]:
    """Dispatch everything the job wants and resolve it; returns the positions produced."""
    seqs = []
    while job.wants_dispatch():
        task, worker = job.next_task(WorkerSlots(2))
        assert worker is None
        job.commit(task)
        job.resolve(batch_delivery(task.seq, stream_id=job.producer_id))
        seqs.append(task.seq)
    return seqs


def test_each_position_is_produced_once_and_handed_to_every_consumer() -> None:
    job, (a, b), refs = job_with(2)
    a.add_plan([(0,), (1,)], end=True)
    b.add_plan([(0,), (1,)], end=True)
    assert run(job) == [0, 1]
    assert [d.seq for d in drain(a)] == [0, 1, -1]
    assert [d.seq for d in drain(b)] == [0, 1, -1]
    # One reference per consumer plus the job's own (its buffer).
    assert refs.count == {0: 3, 1: 3}
    job.discard()
    assert refs.count == {0: 2, 1: 2}


def test_a_late_consumer_is_served_from_the_buffer() -> None:
    job, (a, b), _ = job_with(2)
    a.add_plan([(0,), (1,)], end=True)
    assert run(job) == [0, 1]
    b.add_plan([(0,), (1,)], end=True)
    assert run(job) == [], "buffered batches are not produced again"
    assert [d.seq for d in drain(b)] == [0, 1, -1]


def test_the_buffer_is_bounded_and_a_far_behind_consumer_gets_recomputed_batches() -> None:
    job, (fast, slow), refs = job_with(2, buffer_limit=2)
    fast.add_plan([(i,) for i in range(6)], end=True)
    assert run(job) == list(range(6))
    assert len(job.buffer) == 2
    assert sum(refs.count[s] for s in range(4)) == 4, "trimmed batches lost the job's reference"
    slow.add_plan([(0,)], end=False)
    assert run(job) == [0]
    assert job.recomputed == 1


def test_a_consumer_with_other_indices_fails() -> None:
    _job, (a, b), _ = job_with(2)
    a.add_plan([(0, 1)], end=False)
    b.add_plan([(1, 0)], end=False)
    with pytest.raises(StreamFailed, match="other indices"):
        b.next_delivery(0)


def test_join_checks_parameters() -> None:
    job, _, _ = job_with(0)
    job.check_join(KEY)
    with pytest.raises(ShareMismatchError):
        job.check_join(ShareKey("s", 0, "m", "fp2", True, 7))


def test_a_detached_consumer_waits_for_nothing() -> None:
    job, (a, _b), _ = job_with(2)
    a.add_plan([(0,)], end=False)
    job.detach(a)
    assert job.waiters == {}
    assert run(job) == [0]
    assert job.queued() == 0


def test_a_retried_position_runs_again_first() -> None:
    job, (a,), _ = job_with(1)
    a.add_plan([(0,), (1,)], end=True)
    task, _ = job.next_task(WorkerSlots(2))
    job.commit(task)
    job.retry(task)
    again, _ = job.next_task(WorkerSlots(2))
    assert again is task
    job.commit(again)
    job.resolve(Delivery(seq=0, error=b"x"))
    assert run(job) == [1]
    assert [d.seq for d in drain(a)] == [0, 1, -1]
