"""BatchStream: one client's epoch as the daemon sees it.

A stream turns the client's plan (map-style: index batches; iterable: replica
round-robin) into tasks, collects results that arrive out of order, and hands
them to the servicer strictly in order. It never holds more than ``window``
batches between dispatch and delivery, which is what keeps a slow client from
piling up memory or taking the pool from the others.

A stream is a ``Producer`` (server/scheduling/producer.py) unless it consumes a shared
job: then its plan goes ``upstream``, a window at a time, and the job resolves
its positions.

All methods are called with the scheduler's lock held unless they say otherwise;
``cond`` is a condition on that lock.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loaderd.server.scheduling.client_tally import StreamUse
from loaderd.server.scheduling.ledger import FinishedBatch
from loaderd.server.scheduling.producer import END, Backlog, Delivery, StreamFailed, Upstream, WorkerSlots
from loaderd.server.scheduling.window_fit import WindowFit
from loaderd.server.worker.seeding import derive_seed
from loaderd.server.worker.tasks import BatchTask, FetchTask, Indices, IterTask


@dataclass(frozen=True)
class StreamSpec:
    """What a client's ``OpenStream`` asked for, once checked, and who asked."""

    dataset: str
    iterable: bool
    auto_collation: bool
    batch_size: int  # iterable streams: samples per batch (0: no automatic batching)
    drop_last: bool
    num_workers: int  # iterable streams: torch's num_workers (replicas; 0 means one that sees no worker info)
    base_seed: int
    window: int
    # Positions consumed in an earlier run (resume): plans start there; iterable streams drop them.
    start: int = 0
    client: str = ""
    peer: str = ""
    # Who the daemon verified the caller to be (token name or certificate subject; "" if neither).
    identity: str = ""
    stream_token: int = 0
    # The client's shared-memory session (0: none): batches go as slots leased to it.
    session_id: int = 0
    share: str | None = None  # the share's name, for a consumer of a shared job
    # Plan batches carry their epoch position (a client spreading an epoch over daemons).
    positioned: bool = False


def fetch_task(
    stream_id: int, dataset: str, seq: int, indices: Indices, auto_collation: bool, base_seed: int, position: int | None = None
) -> FetchTask:
    """Item ``seq`` of a map-style plan as a task; its seed follows its epoch position (``seq`` unless
    given), not the worker, so any daemon and any worker produce the same batch."""
    return FetchTask(
        stream_id=stream_id,
        seq=seq,
        dataset=dataset,
        indices=indices,
        auto_collation=auto_collation,
        seed=derive_seed(base_seed, seq if position is None else position),
        position=-1 if position is None else position,
    )


def _size(indices: Indices) -> int:
    return len(indices) if isinstance(indices, tuple) else 1


@dataclass
class _ReplicaCursor:
    next_batch: int = 0
    exhausted_at: int | None = None


@dataclass
class BatchStream:
    stream_id: int
    spec: StreamSpec
    cond: threading.Condition
    # Gives a batch's shared-memory slot back (the ledger's release) once it is sent or dropped.
    release: Callable[[FinishedBatch], None]
    # The shared job that produces this stream's batches (None: the stream is its own producer).
    upstream: Upstream | None = None
    opened_at: float = field(default_factory=time.monotonic)
    # Client-reported: batches taken from the loader (counting ``start``) and time spent waiting.
    consumed: int = 0
    stalled_us: int = 0
    replayed: int = 0  # iterable resume: batches produced again and dropped so far
    pending: deque[tuple[int, Indices]] = field(default_factory=deque)
    # A positioned stream: the epoch position of each planned seq not yet dispatched.
    positions: dict[int, int] = field(default_factory=dict)
    pending_indices: int = 0  # indices in ``pending`` (requests.py caps it)
    asked: int = 0  # a shared job's consumer: positions asked of the job so far
    backlog: Backlog = field(default_factory=Backlog)
    plan_end: bool = False
    planned: int = 0  # seqs assigned so far (map: plan items received; iterable: tasks dispatched)
    ready: dict[int, Delivery] = field(default_factory=dict)
    next_seq: int = 0
    delivered: int = 0
    failure: StreamFailed | None = None
    finished: bool = False  # END was delivered
    # Set by each next_delivery (read by its caller, the one thread that calls it): taking the
    # batch out freed a full window, so the scheduler may dispatch again and must be woken.
    window_freed: bool = False
    closed: bool = False
    # Batches a map-style stream may have computing or ready: its window, narrowed for an elastic pool's size
    # and for the streams sharing the pool now (``fit_window``, server/scheduling/window_fit.py).
    dispatch_window: int = 0
    replicas: list[_ReplicaCursor] = field(default_factory=list)
    replica_turn: int = 0
    slot_replica: dict[int, tuple[int, int]] = field(default_factory=dict)
    replica_slot: dict[int, int] = field(default_factory=dict)  # replica -> the worker slot it lives in (sticky)
    # Wakes the servicer waiting on ``cond`` when the batch it waits for arrives, under the lock: at once (the default),
    # or when the scheduler next waits for the pool (its ``HeldWakeups.wake``: server/scheduling/held_wakeups.py).
    wake_servicer: Callable[[threading.Condition], None] = operator.methodcaller("notify_all")

    def __post_init__(self) -> None:
        self.dispatch_window = self.spec.window
        if self.spec.iterable:
            self.replicas = [_ReplicaCursor() for _ in range(max(1, self.spec.num_workers))]
        else:
            self.planned = self.next_seq = self.asked = self.spec.start
        self.consumed = self.spec.start

    @property
    def producer_id(self) -> int:
        return self.stream_id

    @property
    def dataset(self) -> str:
        return self.spec.dataset

    # ------------------------------------------------------------ planning

    def add_plan(self, batches: list[Indices], end: bool, positions: list[int] | None = None) -> None:
        """Append plan items; a positioned stream gives each one's epoch position in ``positions``."""
        for i, indices in enumerate(batches):
            if positions is not None:
                self.positions[self.planned] = positions[i]
            self.pending.append((self.planned, indices))
            self.pending_indices += _size(indices)
            self.planned += 1
        self.plan_end = self.plan_end or end
        self._ask_upstream()
        if end:
            # Only the plan's end can change what the servicer waits for (``next_delivery``: the stream may be
            # finished now); batches to make are the scheduler's news, and a woken servicer would find nothing.
            self.cond.notify_all()

    def _take_pending(self) -> tuple[int, Indices]:
        seq, indices = self.pending.popleft()
        self.pending_indices -= _size(indices)
        return seq, indices

    def _ask_upstream(self) -> None:
        """A consumer asks its job for the planned positions that fit in its window, no more:
        a consumer that plans far ahead and never reads must not make the pool produce its epoch."""
        if self.upstream is None or self.closed:
            return
        while self.pending and self.pending[0][0] < self.next_seq + self.spec.window:
            seq, indices = self._take_pending()
            self.backlog.expect(seq)
            self.asked = seq + 1
            self.upstream.need(self, seq, indices)

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

    # ------------------------------------------------------------ producing (server/scheduling/producer.py)

    def wants_dispatch(self) -> bool:
        if self.closed or self.failure is not None or self.upstream is not None:
            return False
        if self.backlog.retries:
            return True
        if len(self.backlog.outstanding) + len(self.ready) >= self.dispatch_window:
            return False
        if self.spec.iterable:
            # The credit: never more than ``window`` batches beyond what the client took
            # (batches still inside gRPC's buffers have left ``ready`` but not the client).
            in_credit = self.planned < max(self.consumed, self.spec.start) + self.spec.window
            return in_credit and self._active_replica() is not None
        return bool(self.pending)

    def fit_window(self, fit: WindowFit) -> None:
        """A map-style stream's dispatch window for the pool's state now (server/scheduling/window_fit.py). Under the lock."""
        if not self.spec.iterable:
            self.dispatch_window = fit.window(self.spec.window)

    def _replica_owner(self, replica: int, slots: WorkerSlots) -> int:
        """Iterable replicas live in one worker each, spread over the pool; one stays in its slot while a worker is there."""
        slot = self.replica_slot[replica] = slots.place(self.stream_id + replica, self.replica_slot.get(replica))
        return slot

    def replica_workers(self, slots: WorkerSlots) -> set[int]:
        """The workers that hold this stream's iterable replicas (those placed so far, where a worker still runs)."""
        return {slot for slot in self.replica_slot.values() if not slots.absent(slot)}

    def next_task(self, slots: WorkerSlots) -> tuple[BatchTask, int | None]:
        retry = self.backlog.next_retry()
        if retry is not None:
            return retry, (self._replica_owner(retry.replica, slots) if isinstance(retry, IterTask) else None)
        spec = self.spec
        if spec.iterable:
            r = self._active_replica()
            assert r is not None
            task: BatchTask = IterTask(
                stream_id=self.stream_id,
                seq=self.planned,
                dataset=spec.dataset,
                replica=r,
                num_replicas=spec.num_workers,
                batch_index=self.replicas[r].next_batch,
                batch_size=spec.batch_size,
                drop_last=spec.drop_last,
                base_seed=spec.base_seed,
            )
            return task, self._replica_owner(r, slots)
        seq, indices = self.pending[0]
        task = fetch_task(
            self.stream_id, spec.dataset, seq, indices, spec.auto_collation, spec.base_seed, self.positions.get(seq)
        )
        return task, None

    def commit(self, task: BatchTask) -> None:
        if self.backlog.sent(task):
            return
        if isinstance(task, IterTask):
            self.slot_replica[task.seq] = (task.replica, task.batch_index)
            self.replicas[task.replica].next_batch += 1
            self.replica_turn = (task.replica + 1) % len(self.replicas)
            self.planned += 1
        else:
            seq, _ = self._take_pending()
            self.positions.pop(seq, None)

    def retry(self, task: BatchTask) -> None:
        self.backlog.retry(task)

    def queued(self) -> int:
        return len(self.pending) + len(self.backlog.retries)

    def in_flight(self) -> int:
        """Batches computing or ready to send (status)."""
        return len(self.backlog.outstanding) + len(self.ready)

    # ------------------------------------------------------------ results

    def resolve(self, delivery: Delivery) -> None:
        seq = delivery.seq
        if not self.backlog.settle(seq):
            self._drop(delivery)  # a duplicate from a worker that was presumed dead
            return
        if self.spec.iterable and seq in self.slot_replica:
            replica, batch_index = self.slot_replica.pop(seq)
            cursor = self.replicas[replica]
            if delivery.exhausted:
                # An error that ends its replica (a batch past its task_timeout) is delivered; the replica ends after it.
                end = batch_index + 1 if delivery.error is not None else batch_index
                cursor.exhausted_at = end if cursor.exhausted_at is None else min(cursor.exhausted_at, end)
            if cursor.exhausted_at is not None and batch_index >= cursor.exhausted_at:
                self._drop(delivery)
                delivery = Delivery(seq=seq)  # torch drops what a spent worker was still asked for
        self.ready[seq] = delivery
        if seq == self.next_seq:
            # A batch ahead of the one the servicer waits for changes nothing it waits on (the stream is not finished
            # while it is ready): one in three arrive so with 2 workers, and each woke the servicer for nothing.
            self.wake_servicer(self.cond)

    def _drop(self, delivery: Delivery) -> None:
        if delivery.batch is not None:
            self.release(delivery.batch)

    def use(self, now: float) -> StreamUse:
        """This stream's part in its client's figures (``loaderd status``): batches sent, time waited, time open."""
        spec = self.spec
        # Batches sent, not taken: a client reports what it took with its next request, and the
        # last ones of an epoch are followed by none (a loop that breaks early took fewer).
        return StreamUse(
            client=spec.client,
            identity=spec.identity,
            dataset=spec.dataset,
            batches=self.delivered,
            waited_s=self.stalled_us / 1e6,
            active_s=max(0.0, now - self.opened_at),
        )

    def fail(self, failure: StreamFailed) -> None:
        if self.failure is None:
            self.failure = failure
        self.cond.notify_all()

    def close(self) -> bool:
        """The stream is closed: give back every payload it still holds. False if it was already closed."""
        if self.closed:
            return False
        self.closed = True
        for delivery in self.ready.values():
            self._drop(delivery)
        self.ready.clear()
        self.cond.notify_all()
        return True

    def _finished(self) -> bool:
        if self.backlog or self.ready:
            return False
        if self.spec.iterable:
            return self._active_replica() is None and self.next_seq == self.planned
        return self.plan_end and not self.pending and self.next_seq == self.planned

    def next_delivery(self, timeout: float) -> Delivery | None:
        """The next batch in order, END, or None if none arrived within ``timeout``.

        Called by the servicer without the lock (it takes ``cond``); raises StreamFailed.
        """
        with self.cond:
            self.window_freed = False
            while True:
                if self.failure is not None:
                    raise self.failure
                delivery = self.ready.pop(self.next_seq, None)
                if delivery is not None:
                    # Otherwise the window did not hold dispatch back, and this changes nothing for
                    # the scheduler (a shared job's consumer asks the job for more: always news).
                    self.window_freed = self.window_freed or self.upstream is not None or (
                        len(self.backlog.outstanding) + len(self.ready) + 1 >= self.dispatch_window
                    )
                    self.next_seq += 1
                    self._ask_upstream()  # its window moved on
                    if delivery.skipped:
                        if self.window_freed:
                            # The window moved: the scheduler must hear it now (the caller wakes it), or the next
                            # batch, not yet dispatched, would wait out the caller's whole timeout.
                            return None
                        continue
                    if self.spec.iterable and self.replayed < self.spec.start:
                        # Resuming: the client had this batch before; the caller drops it.
                        self.replayed += 1
                        return dataclasses.replace(delivery, replay=True)
                    self.delivered += 1
                    return delivery
                if self._finished():
                    self.finished = True
                    return END
                if not self.cond.wait(timeout):
                    return None
