"""BatchStream: one client's epoch as the daemon sees it.

A stream turns the client's plan (map-style: index batches; iterable: replica
round-robin) into tasks, collects results that arrive out of order, and hands
them to the servicer strictly in order. It never holds more than ``window``
batches between dispatch and delivery, which is what keeps a slow client from
piling up memory or taking the pool from the others.

All methods are called with the scheduler's lock held unless they say otherwise;
``cond`` is a condition on that lock.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from loaderd.server.pool import WorkerResult
from loaderd.server.seeding import derive_seed
from loaderd.server.tasks import FetchTask, IterTask, Task

if TYPE_CHECKING:
    from loaderd.server.share import SharedJob


@dataclass(frozen=True)
class Delivery:
    """A resolved position of the stream: a batch, a user error, or nothing (a spent replica)."""

    seq: int
    batch: WorkerResult | None = None  # a BatchDone and its payload
    error: bytes | None = None  # serialized RemoteError
    # Resuming an iterable stream: produced again only to reach the resume point; not sent.
    replay: bool = False

    @property
    def skipped(self) -> bool:
        return self.batch is None and self.error is None


END = Delivery(seq=-1)


class StreamFailed(Exception):
    """The stream cannot go on; carries the gRPC status to end it with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def fetch_task(
    stream_id: int, dataset: str, seq: int, indices: tuple[int, ...] | int, auto_collation: bool, base_seed: int
) -> FetchTask:
    """Position ``seq`` of a map-style plan as a task; its seed follows the position, not the worker."""
    return FetchTask(
        stream_id=stream_id,
        seq=seq,
        dataset=dataset,
        indices=indices,
        auto_collation=auto_collation,
        seed=derive_seed(base_seed, seq),
    )


@dataclass
class _ReplicaCursor:
    next_batch: int = 0
    exhausted_at: int | None = None


@dataclass
class BatchStream:
    stream_id: int
    dataset: str
    iterable: bool
    auto_collation: bool
    batch_size: int
    drop_last: bool
    num_workers: int
    base_seed: int
    window: int
    peer: str
    stream_token: int
    cond: threading.Condition
    # Gives a batch's shared-memory payload back to its worker once it is sent or dropped.
    release: Callable[[WorkerResult], None]
    # Positions consumed in an earlier run (resume): plans start there; iterable streams drop them.
    start: int = 0
    client: str = ""
    shm: bool = False
    # Set when the stream is a consumer of a shared job: the job produces, the stream only receives.
    job: SharedJob | None = None
    opened_at: float = field(default_factory=time.monotonic)
    # Client-reported: batches taken from the loader (counting ``start``) and time spent waiting.
    consumed: int = 0
    stalled_us: int = 0
    replayed: int = 0  # iterable resume: batches produced again and dropped so far
    pending: deque[tuple[int, tuple[int, ...] | int]] = field(default_factory=deque)
    retries: list[Task] = field(default_factory=list)
    plan_end: bool = False
    planned: int = 0  # seqs assigned so far (map: plan items received; iterable: tasks dispatched)
    outstanding: set[int] = field(default_factory=set)
    ready: dict[int, Delivery] = field(default_factory=dict)
    next_seq: int = 0
    delivered: int = 0
    failure: StreamFailed | None = None
    finished: bool = False  # END was delivered
    closed: bool = False
    replicas: list[_ReplicaCursor] = field(default_factory=list)
    replica_turn: int = 0
    slot_replica: dict[int, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.iterable:
            self.replicas = [_ReplicaCursor() for _ in range(max(1, self.num_workers))]
        else:
            self.planned = self.next_seq = self.start
        self.consumed = self.start

    # ------------------------------------------------------------ planning

    def add_plan(self, batches: list[tuple[int, ...] | int], end: bool) -> None:
        for indices in batches:
            if self.job is not None:
                self.outstanding.add(self.planned)
                self.job.need(self, self.planned, indices)
            else:
                self.pending.append((self.planned, indices))
            self.planned += 1
        self.plan_end = self.plan_end or end
        self.cond.notify_all()

    def progress(self, consumed: int, stalled_us: int) -> None:
        """The client's report of what it consumed (the credit of iterable streams) and waited."""
        self.consumed = max(self.consumed, consumed)
        self.stalled_us = max(self.stalled_us, stalled_us)

    def _active_replica(self) -> int | None:
        """The replica whose turn it is in torch's round-robin, skipping spent ones."""
        n = len(self.replicas)
        for step in range(n):
            r = (self.replica_turn + step) % n
            if self.replicas[r].exhausted_at is None:
                return r
        return None

    def wants_dispatch(self) -> bool:
        if self.closed or self.failure is not None or self.job is not None:
            return False
        if self.retries:
            return True
        if len(self.outstanding) + len(self.ready) >= self.window:
            return False
        if self.iterable:
            # The credit: never more than ``window`` batches beyond what the client took
            # (batches still inside gRPC's buffers have left ``ready`` but not the client).
            in_credit = self.planned < max(self.consumed, self.start) + self.window
            return in_credit and self._active_replica() is not None
        return bool(self.pending)

    def replica_owner(self, replica: int, pool_size: int) -> int:
        """Iterable replicas live in one worker each, spread over the pool."""
        return (self.stream_id + replica) % pool_size

    def next_task(self, pool_size: int) -> tuple[Task, int | None]:
        """The next task to run and the worker it must run on (None: any). Does not consume it."""
        if self.retries:
            task = self.retries[0]
            return task, (self.replica_owner(task.replica, pool_size) if isinstance(task, IterTask) else None)
        if self.iterable:
            r = self._active_replica()
            assert r is not None
            task: Task = IterTask(
                stream_id=self.stream_id,
                seq=self.planned,
                dataset=self.dataset,
                replica=r,
                num_replicas=self.num_workers,
                batch_index=self.replicas[r].next_batch,
                batch_size=self.batch_size,
                drop_last=self.drop_last,
                base_seed=self.base_seed,
            )
            return task, self.replica_owner(r, pool_size)
        seq, indices = self.pending[0]
        return fetch_task(self.stream_id, self.dataset, seq, indices, self.auto_collation, self.base_seed), None

    def commit(self, task: Task) -> None:
        """``task`` (from next_task) was sent to a worker."""
        if self.retries and self.retries[0] is task:
            self.retries.pop(0)
        elif isinstance(task, IterTask):
            self.slot_replica[task.seq] = (task.replica, task.batch_index)
            self.replicas[task.replica].next_batch += 1
            self.replica_turn = (task.replica + 1) % len(self.replicas)
            self.planned += 1
        else:
            self.pending.popleft()
        self.outstanding.add(task.seq)

    def retry(self, task: Task) -> None:
        """A worker died holding ``task``: run it again before anything new."""
        self.outstanding.discard(task.seq)
        self.retries.append(task)
        self.retries.sort(key=lambda t: t.seq)

    # ------------------------------------------------------------ results

    def resolve(self, delivery: Delivery) -> None:
        seq = delivery.seq
        if seq not in self.outstanding:
            self._drop(delivery)  # a duplicate from a worker that was presumed dead
            return
        self.outstanding.discard(seq)
        if self.iterable and seq in self.slot_replica:
            replica, batch_index = self.slot_replica.pop(seq)
            cursor = self.replicas[replica]
            if cursor.exhausted_at is not None and batch_index >= cursor.exhausted_at:
                self._drop(delivery)
                delivery = Delivery(seq=seq)  # torch drops what a spent worker was still asked for
        self.ready[seq] = delivery
        self.cond.notify_all()

    def replica_exhausted(self, seq: int) -> None:
        if seq in self.slot_replica:
            replica, batch_index = self.slot_replica[seq]
            cursor = self.replicas[replica]
            cursor.exhausted_at = batch_index if cursor.exhausted_at is None else min(cursor.exhausted_at, batch_index)
        self.resolve(Delivery(seq=seq))

    def _drop(self, delivery: Delivery) -> None:
        if delivery.batch is not None:
            self.release(delivery.batch)

    def discard(self) -> None:
        """The stream is closed: give back every payload it still holds."""
        for delivery in self.ready.values():
            self._drop(delivery)
        self.ready.clear()

    def fail(self, failure: StreamFailed) -> None:
        if self.failure is None:
            self.failure = failure
        self.cond.notify_all()

    def _finished(self) -> bool:
        if self.outstanding or self.retries or self.ready:
            return False
        if self.iterable:
            return self._active_replica() is None and self.next_seq == self.planned
        return self.plan_end and not self.pending and self.next_seq == self.planned

    def next_delivery(self, timeout: float) -> Delivery | None:
        """The next batch in order, END, or None if none arrived within ``timeout``.

        Called by the servicer without the lock; raises StreamFailed.
        """
        with self.cond:
            while True:
                if self.failure is not None:
                    raise self.failure
                delivery = self.ready.pop(self.next_seq, None)
                if delivery is not None:
                    self.next_seq += 1
                    if delivery.skipped:
                        continue
                    if self.iterable and self.replayed < self.start:
                        # Resuming: the client had this batch before; the caller drops it.
                        self.replayed += 1
                        return dataclasses.replace(delivery, replay=True)
                    self.delivered += 1
                    return delivery
                if self._finished():
                    return END
                if not self.cond.wait(timeout):
                    return None
