"""The producer contract: what the scheduler dispatches from and routes results to.

Two kinds of producer exist: a client's ``BatchStream`` (server/scheduling/stream.py) and
a ``SharedJob`` (server/scheduling/share.py) that produces one epoch for several
consumer streams. The scheduler sees only this contract. Its rules:

- Every method runs with the scheduler's lock held.
- ``next_task`` only looks; the task is the producer's again until ``commit``
  says a worker took it. A task that a dying worker held comes back through
  ``retry`` and is dispatched again, before any new work, in position order.
  Work pinned to one worker (an iterable replica) names its slot with
  ``WorkerSlots.owner``.
- ``resolve`` receives each position's result once; a second result for the
  same position (a worker presumed dead that finished after all) is released
  and dropped. ``Backlog`` keeps that bookkeeping for every producer alike.
- A ``Delivery`` holding a shared-memory batch holds one reference to its slot
  (server/scheduling/ledger.py): whoever drops a delivery releases it.

A consumer stream of a shared job is no producer: its plan goes ``Upstream``
to the job, which hands results back through the ``Consumer`` side.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from loaderd.server.scheduling.ledger import FinishedBatch
from loaderd.server.worker.tasks import BatchTask, Indices
from loaderd.wire.rendezvous import rendezvous


@dataclass(frozen=True)
class Delivery:
    """A resolved position: a batch, a user error, or nothing (a spent replica)."""

    seq: int
    batch: FinishedBatch | None = None  # holds one reference to its slot, if any
    error: bytes | None = None  # serialized RemoteError
    # The iterable replica this position asked for had nothing left (with ``error``:
    # this position fails and its replica ends after it).
    exhausted: bool = False
    # Resuming an iterable stream: produced again only to reach the resume point; not sent.
    replay: bool = False

    @property
    def skipped(self) -> bool:
        return self.batch is None and self.error is None


END = Delivery(seq=-1)


@dataclass(frozen=True)
class WorkerSlots:
    """The pool's worker slots as producers see them: how many, which were given up for good, which an
    elastic pool parked (no worker now; one may come back), and which are leaving it (draining)."""

    size: int
    given_up: frozenset[int] = frozenset()
    parked: frozenset[int] = frozenset()
    leaving: frozenset[int] = frozenset()

    def absent(self, slot: int) -> bool:
        """Whether no worker runs in ``slot`` now (given up, or parked): work pinned to it must move."""
        return slot in self.given_up or slot in self.parked

    def owner(self, key: int) -> int:
        """The slot new work pinned by ``key`` (an iterable replica) goes to: ``key % size``, or, if that slot
        is absent or leaving, one of the others (rendezvous hashing: spread over the slots left, and the same
        whatever else is given up).

        Placement is sticky: a producer keeps a replica where it first put it (``place``) and moves it only
        when that slot's worker is gone for good or parked, with the replica it held: the new owner builds the
        replica and replays it to where it was, as a replacement worker does, and ``ReleaseStream`` reaches
        every worker that holds one. A slot coming back (an elastic pool growing) moves nothing. With every
        slot absent there is none to move to (the daemon is shutting down).
        """
        slot = key % self.size
        if not self.absent(slot) and slot not in self.leaving:
            return slot
        left = [str(w) for w in range(self.size) if not self.absent(w) and w not in self.leaving]
        left = left or [str(w) for w in range(self.size) if not self.absent(w)]
        return int(rendezvous(str(key), left)) if left else slot

    def place(self, key: int, current: int | None) -> int:
        """Where work pinned by ``key`` runs: ``current`` (where it ran so far) while a worker is there, else ``owner``."""
        return current if current is not None and not self.absent(current) else self.owner(key)


class FailReason(enum.Enum):
    """Why a stream cannot go on, in the daemon's terms (the RPC layer maps each to a gRPC status:
    server/rpc/refusals.py ``FAILURES``)."""

    UNAVAILABLE = "unavailable"  # the daemon cannot serve it (stopping, no worker can run it): elsewhere, it may
    INTERNAL = "internal"  # the daemon failed handling it: its own bug
    INVALID = "invalid"  # the client's request is malformed or out of range
    MISMATCH = "mismatch"  # the request contradicts what the stream already is (a share's plan)
    LIMIT = "limit"  # the request is over one of the daemon's limits


class StreamFailed(Exception):
    """The stream cannot go on, and why (``reason``); the message is what the client reads."""

    def __init__(self, reason: FailReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Producer(Protocol):
    """Something the scheduler hands out tasks for (see the module docstring for the rules)."""

    @property
    def producer_id(self) -> int:
        """The id the tasks carry (``Task.stream_id``): results are routed back by it."""
        ...

    def wants_dispatch(self) -> bool:
        """Whether a task is ready to run (and its window has room)."""
        ...

    def next_task(self, slots: WorkerSlots) -> tuple[BatchTask, int | None]:
        """The next task and the worker slot it must run on (None: any). Does not consume it."""
        ...

    def commit(self, task: BatchTask) -> None:
        """``task`` (from ``next_task``) went to a worker."""
        ...

    def retry(self, task: BatchTask) -> None:
        """A worker died holding ``task``: run it again before anything new."""
        ...

    def resolve(self, delivery: Delivery) -> None:
        """A position's result (or a duplicate of one, to be released)."""
        ...

    def queued(self) -> int:
        """Tasks waiting for a worker (status)."""
        ...


class Consumer(Protocol):
    """A stream fed by a shared job."""

    @property
    def asked(self) -> int:
        """Positions this consumer has asked the job for so far (the job trims its buffer behind the slowest)."""
        ...

    def resolve(self, delivery: Delivery) -> None: ...

    def fail(self, failure: StreamFailed) -> None: ...


class Upstream(Protocol):
    """Where a consumer's plan goes: the shared job that produces its batches."""

    def need(self, consumer: Consumer, seq: int, indices: Indices) -> None:
        """``consumer`` asks for position ``seq`` with ``indices``.

        A consumer asks only for positions within its window (``seq`` < its next
        undelivered position + window), so what a job hands out is bounded by its
        consumers' windows however far ahead they plan.
        """
        ...


@dataclass
class Backlog:
    """Positions a producer has handed to workers and not yet got back, and tasks to re-run first."""

    outstanding: set[int] = field(default_factory=set)
    retries: list[BatchTask] = field(default_factory=list)

    def next_retry(self) -> BatchTask | None:
        return self.retries[0] if self.retries else None

    def sent(self, task: BatchTask) -> bool:
        """``task`` went to a worker; True if it was the retry at the head (else it was new work)."""
        was_retry = bool(self.retries) and self.retries[0] is task
        if was_retry:
            self.retries.pop(0)
        self.outstanding.add(task.seq)
        return was_retry

    def retry(self, task: BatchTask) -> None:
        self.outstanding.discard(task.seq)
        self.retries.append(task)
        self.retries.sort(key=lambda t: t.seq)

    def expect(self, seq: int) -> None:
        """Position ``seq`` will be resolved by someone else (a consumer's shared job)."""
        self.outstanding.add(seq)

    def settle(self, seq: int) -> bool:
        """The result for ``seq`` arrived: True the first time, False for a duplicate."""
        if seq not in self.outstanding:
            return False
        self.outstanding.discard(seq)
        return True

    def holds(self, seq: int) -> bool:
        """Whether ``seq`` is running or waiting to run again."""
        return seq in self.outstanding or any(t.seq == seq for t in self.retries)

    def __len__(self) -> int:
        return len(self.outstanding) + len(self.retries)

    def clear(self) -> None:
        self.outstanding.clear()
        self.retries.clear()
