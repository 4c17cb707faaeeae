"""SharedJob: one epoch of a share, produced once and delivered to every consumer.

Clients that open a stream with the same share name and epoch (and the same
loader parameters) are consumers of one job. Each consumer plans its epoch as
usual; the job checks that every consumer asks for the same indices at each
position, runs each position once on the pool, and hands the result to every
consumer that asked for it (the shared-memory slot gains one reference per
consumer, see ``SlotLedger.retain``).

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

from loaderd.server.scheduling.ledger import FinishedBatch
from loaderd.server.scheduling.producer import Backlog, Consumer, Delivery, FailReason, StreamFailed, WorkerSlots
from loaderd.server.scheduling.stream import fetch_task
from loaderd.server.worker.tasks import BatchTask, Indices


class ShareMismatchError(Exception):
    """A stream asked to join a share with other loader parameters."""


@dataclass(frozen=True)
class ShareKey:
    """What identifies a shared job and what its consumers must agree on."""

    name: str
    epoch: int
    dataset: str
    fingerprint: str
    auto_collation: bool
    base_seed: int


@dataclass
class SharedJob:
    job_id: int  # the producer id its tasks carry
    key: ShareKey
    buffer_limit: int
    retain: Callable[[FinishedBatch], None]
    release: Callable[[FinishedBatch], None]
    consumers: list[Consumer] = field(default_factory=list)
    # The indices each position was first asked for: every consumer must agree.
    plan: dict[int, Indices] = field(default_factory=dict)
    queue: list[tuple[int, Indices]] = field(default_factory=list)  # heap by position
    queued_seqs: set[int] = field(default_factory=set)
    backlog: Backlog = field(default_factory=Backlog)
    waiters: dict[int, list[Consumer]] = field(default_factory=dict)
    buffer: OrderedDict[int, Delivery] = field(default_factory=OrderedDict)
    produced_once: set[int] = field(default_factory=set)
    produced: int = 0
    recomputed: int = 0
    closed: bool = False

    @property
    def name(self) -> str:
        return self.key.name

    @property
    def epoch(self) -> int:
        return self.key.epoch

    @property
    def dataset(self) -> str:
        return self.key.dataset

    @property
    def producer_id(self) -> int:
        return self.job_id

    # ------------------------------------------------------------ consumers

    def check_join(self, key: ShareKey) -> None:
        """Raise ShareMismatchError unless a stream asking for ``key`` may join."""
        mine = self.key
        if (key.fingerprint, key.dataset, key.auto_collation) != (mine.fingerprint, mine.dataset, mine.auto_collation):
            raise ShareMismatchError(
                f"share {mine.name!r} (epoch {mine.epoch}) was opened with [{mine.fingerprint}]; "
                f"this loader has [{key.fingerprint}]: every loader of a share needs the same parameters"
            )
        if key.base_seed != mine.base_seed:
            raise ShareMismatchError(
                f"share {mine.name!r} (epoch {mine.epoch}): this loader drew another base seed than the share's "
                "(loaders of a share must not pass their own generator)"
            )

    def attach(self, consumer: Consumer) -> None:
        self.consumers.append(consumer)

    def detach(self, consumer: Consumer) -> None:
        """A consumer closed: forget what it waited for; drop what nobody needs any more."""
        if consumer in self.consumers:
            self.consumers.remove(consumer)
        for seq, waiting in list(self.waiters.items()):
            if consumer in waiting:
                waiting.remove(consumer)
            if not waiting:
                del self.waiters[seq]

    def need(self, consumer: Consumer, seq: int, indices: Indices) -> None:
        """``consumer`` planned position ``seq``: serve it from the buffer, or wait for the pool."""
        known = self.plan.setdefault(seq, indices)
        if known != indices:
            consumer.fail(
                StreamFailed(
                    FailReason.MISMATCH,
                    f"share {self.name!r} (epoch {self.epoch}): batch {seq} of this loader has other indices than "
                    "the share's; every loader of a share must sample the same batches (same sampler and seed)",
                )
            )
            return
        buffered = self.buffer.get(seq)
        if buffered is not None:
            self._hand(consumer, buffered)
            return
        self.waiters.setdefault(seq, []).append(consumer)
        if seq in self.queued_seqs or self.backlog.holds(seq):
            return
        if seq in self.produced_once:
            self.recomputed += 1
        heapq.heappush(self.queue, (seq, indices))
        self.queued_seqs.add(seq)

    def _hand(self, consumer: Consumer, delivery: Delivery) -> None:
        if delivery.batch is not None:
            self.retain(delivery.batch)
        consumer.resolve(delivery)

    # ------------------------------------------------------------ producing (server/scheduling/producer.py)

    def wants_dispatch(self) -> bool:
        return not self.closed and bool(self.backlog.retries or self.queue)

    def next_task(self, slots: WorkerSlots) -> tuple[BatchTask, int | None]:
        retry = self.backlog.next_retry()
        if retry is not None:
            return retry, None
        seq, indices = self.queue[0]
        key = self.key
        return fetch_task(self.job_id, key.dataset, seq, indices, key.auto_collation, key.base_seed), None

    def commit(self, task: BatchTask) -> None:
        if not self.backlog.sent(task):
            heapq.heappop(self.queue)
            self.queued_seqs.discard(task.seq)

    def retry(self, task: BatchTask) -> None:
        self.backlog.retry(task)

    def queued(self) -> int:
        return len(self.queue) + len(self.backlog.retries)

    def resolve(self, delivery: Delivery) -> None:
        """The pool finished a position: every waiting consumer gets it; keep it for those still to come."""
        seq = delivery.seq
        if not self.backlog.settle(seq):
            self._drop(delivery)
            return
        self.produced += 1
        self.produced_once.add(seq)
        for consumer in self.waiters.pop(seq, []):
            self._hand(consumer, delivery)
        self.buffer[seq] = delivery  # the job's own reference, for consumers still to come
        self._trim()

    def _trim(self) -> None:
        """Beyond the limit, drop a batch every consumer is past, else the oldest."""
        while len(self.buffer) > self.buffer_limit:
            horizon = min((consumer.asked for consumer in self.consumers), default=0)
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
        self.queued_seqs.clear()
        self.backlog.clear()
        self.waiters.clear()
