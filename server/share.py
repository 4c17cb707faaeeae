"""SharedJob: one epoch of a share, produced once and delivered to every consumer.

Clients that open a stream with the same share name and epoch (and the same
loader parameters) are consumers of one job. Each consumer plans its epoch as
usual; the job checks that every consumer asks for the same indices at each
position, runs each position once on the pool, and hands the result to every
consumer that asked for it (the shared-memory slot gains one reference per
consumer, see ``WorkerPool.retain``).

The job keeps the last ``buffer_limit`` batches it produced: a consumer that
joins a little late, or reads a little slower, takes them from there. Past the
limit, batches every consumer has passed go first, then the oldest; whoever
still needs a dropped batch gets it produced again. So a consumer that joins
late or reads slowly still gets its whole epoch, a fast one is never held back,
and the daemon's memory stays bounded.

Like BatchStream, every method runs with the scheduler's lock held.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from loaderd.server.pool import WorkerResult
from loaderd.server.stream import BatchStream, Delivery, StreamFailed, fetch_task
from loaderd.server.tasks import Task


class ShareMismatchError(Exception):
    """A stream asked to join a share with other loader parameters."""


@dataclass
class SharedJob:
    job_id: int  # also the stream_id its tasks carry
    name: str
    epoch: int
    dataset: str
    fingerprint: str
    auto_collation: bool
    base_seed: int
    buffer_limit: int
    retain: Callable[[WorkerResult], None]
    release: Callable[[WorkerResult], None]
    consumers: list[BatchStream] = field(default_factory=list)
    # The indices each position was first asked for: every consumer must agree.
    plan: dict[int, tuple[int, ...] | int] = field(default_factory=dict)
    queue: list[tuple[int, tuple[int, ...] | int]] = field(default_factory=list)  # heap by position
    queued: set[int] = field(default_factory=set)
    outstanding: set[int] = field(default_factory=set)
    retries: list[Task] = field(default_factory=list)
    waiters: dict[int, list[BatchStream]] = field(default_factory=dict)
    buffer: OrderedDict[int, Delivery] = field(default_factory=OrderedDict)
    produced_once: set[int] = field(default_factory=set)
    produced: int = 0
    recomputed: int = 0
    closed: bool = False

    # ------------------------------------------------------------ consumers

    def check_join(self, dataset: str, fingerprint: str, auto_collation: bool, base_seed: int) -> None:
        """Raise ShareMismatchError unless a stream with these parameters may join."""
        if fingerprint != self.fingerprint or dataset != self.dataset or auto_collation != self.auto_collation:
            raise ShareMismatchError(
                f"share {self.name!r} (epoch {self.epoch}) was opened with [{self.fingerprint}]; "
                f"this loader has [{fingerprint}]: every loader of a share needs the same parameters"
            )
        if base_seed != self.base_seed:
            raise ShareMismatchError(
                f"share {self.name!r} (epoch {self.epoch}): this loader drew another base seed than the share's "
                "(loaders of a share must not pass their own generator)"
            )

    def attach(self, stream: BatchStream) -> None:
        stream.job = self
        self.consumers.append(stream)

    def detach(self, stream: BatchStream) -> None:
        """A consumer closed: forget what it waited for; drop what nobody needs any more."""
        if stream in self.consumers:
            self.consumers.remove(stream)
        for seq, streams in list(self.waiters.items()):
            if stream in streams:
                streams.remove(stream)
            if not streams:
                del self.waiters[seq]

    def need(self, stream: BatchStream, seq: int, indices: tuple[int, ...] | int) -> None:
        """``stream`` planned position ``seq``: serve it from the buffer, or wait for the pool."""
        known = self.plan.setdefault(seq, indices)
        if known != indices:
            stream.fail(
                StreamFailed(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"share {self.name!r} (epoch {self.epoch}): batch {seq} of this loader has other indices than "
                    "the share's; every loader of a share must sample the same batches (same sampler and seed)",
                )
            )
            return
        buffered = self.buffer.get(seq)
        if buffered is not None:
            self._hand(stream, buffered)
            return
        self.waiters.setdefault(seq, []).append(stream)
        if seq in self.outstanding or seq in self.queued or any(t.seq == seq for t in self.retries):
            return
        if seq in self.produced_once:
            self.recomputed += 1
        heapq.heappush(self.queue, (seq, indices))
        self.queued.add(seq)

    def _hand(self, stream: BatchStream, delivery: Delivery) -> None:
        if delivery.batch is not None:
            self.retain(delivery.batch)
        stream.resolve(delivery)

    # ------------------------------------------------------------ producer side (as BatchStream)

    @property
    def stream_id(self) -> int:
        return self.job_id

    def wants_dispatch(self) -> bool:
        return not self.closed and bool(self.retries or self.queue)

    def next_task(self, pool_size: int) -> tuple[Task, int | None]:
        if self.retries:
            return self.retries[0], None
        seq, indices = self.queue[0]
        return fetch_task(self.job_id, self.dataset, seq, indices, self.auto_collation, self.base_seed), None

    def commit(self, task: Task) -> None:
        if self.retries and self.retries[0] is task:
            self.retries.pop(0)
        else:
            heapq.heappop(self.queue)
            self.queued.discard(task.seq)
        self.outstanding.add(task.seq)

    def retry(self, task: Task) -> None:
        self.outstanding.discard(task.seq)
        self.retries.append(task)
        self.retries.sort(key=lambda t: t.seq)

    def resolve(self, delivery: Delivery) -> None:
        """The pool finished a position: every waiting consumer gets it; keep it for those still to come."""
        seq = delivery.seq
        if seq not in self.outstanding:
            self._drop(delivery)
            return
        self.outstanding.discard(seq)
        self.produced += 1
        self.produced_once.add(seq)
        for stream in self.waiters.pop(seq, []):
            self._hand(stream, delivery)
        self.buffer[seq] = delivery  # the job's own reference, for consumers still to come
        self._trim()

    def replica_exhausted(self, seq: int) -> None:  # map-style only: never sent
        self.resolve(Delivery(seq=seq))

    def fail(self, failure: StreamFailed) -> None:
        """Consumers are failed one by one; the job itself only stops."""

    def _trim(self) -> None:
        """Beyond the limit, drop a batch every consumer is past, else the oldest."""
        while len(self.buffer) > self.buffer_limit:
            horizon = min((stream.planned for stream in self.consumers), default=0)
            victim = next((seq for seq in self.buffer if seq < horizon), next(iter(self.buffer)))
            self._drop(self.buffer.pop(victim))

    def _drop(self, delivery: Delivery) -> None:
        if delivery.batch is not None:
            self.release(delivery.batch)

    def discard(self) -> None:
        """The last consumer left: give back every buffered payload."""
        self.closed = True
        for delivery in self.buffer.values():
            self._drop(delivery)
        self.buffer.clear()
        self.queue.clear()
        self.queued.clear()
        self.retries.clear()
        self.waiters.clear()

    @property
    def in_flight(self) -> int:
        return len(self.outstanding) + len(self.queue) + len(self.retries)
