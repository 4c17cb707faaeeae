"""SlotLedger: the one owner of a shared-memory slot's lifetime in the daemon.

A worker that finishes a batch in shared memory sends only the slot's name; from
then on the slot belongs to the ledger until every holder has let go. Everyone
else (scheduler, streams, shared jobs, the servicer, client sessions) only calls
these operations:

  receive  a worker's ``BatchDone`` arrives: its slot is mapped (once per
           segment) and held once, by the ``FinishedBatch`` returned.
  retain   one more holder of the same batch (a shared job handing it to a
           second consumer): it takes one more release to let go.
  lease    a holder hands its reference to a client's session; the lease id
           travels in the ``SlotHandle`` and the client releases it by id.
  release  a holder is done (sent as bytes, dropped, a lease given back, or the
           client's session ended). At zero holders the slot goes back to its
           worker, which may reuse it.
  retire   a worker died: its segments are unlinked as soon as none of its
           slots is held, so a client can still map a batch that worker finished.
  forget   a worker destroyed idle segments: the daemon's mappings are dropped.

Removed segments are announced through ``on_retired`` so clients unmap them.
``close`` unlinks every segment of the daemon (shutdown). All operations are
thread-safe; the callbacks run outside the ledger's lock.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from loaderd.errors import TransportError
from loaderd.server.shm.arena import SlotReader, SlotRef, unlink_segments
from loaderd.server.worker.tasks import BatchDone


@dataclass(frozen=True)
class FinishedBatch:
    """A finished batch: its ``BatchDone`` and the payload as (offset, bytes) buffers.

    A payload in shared memory is one buffer at offset 0 (a view of the slot)
    that stays valid until the ledger's last release of this batch.
    """

    worker_id: int
    generation: int
    done: BatchDone
    buffers: tuple[tuple[int, bytes | memoryview], ...] = ()

    @property
    def slot(self) -> SlotRef | None:
        return self.done.slot


# (worker id, generation, segment name): one slot of one worker process.
_SlotKey = tuple[int, int, str]
# Gives a slot back to its worker: (worker id, generation, segment name).
GiveBack = Callable[[int, int, str], None]
# Announces removed segments to clients: (segment names, name prefixes).
OnRetired = Callable[[tuple[str, ...], tuple[str, ...]], None]


@dataclass
class _Session:
    """One client session's leases: lease id -> (batch, the stream token it was sent on)."""

    leases: dict[int, tuple[FinishedBatch, int]] = field(default_factory=dict)
    abandoned: set[int] = field(default_factory=set)


class SlotLedger:
    """Reference counts, leases and retirement of every worker slot (see the module docstring)."""

    def __init__(self, shm_prefix: str | None, give_back: GiveBack, on_retired: OnRetired) -> None:
        self._prefix = shm_prefix
        self._give_back = give_back
        self._on_retired = on_retired
        self._lock = threading.Lock()
        self._reader = SlotReader()
        self._refs: dict[_SlotKey, int] = {}
        # Slots held per worker process, and the segment prefixes of dead ones waiting for zero.
        self._held: dict[tuple[int, int], int] = {}
        self._retiring: dict[tuple[int, int], str] = {}
        self._sessions: dict[int, _Session] = {}
        self._lease_ids = itertools.count(1)

    # ------------------------------------------------------------ holding

    def receive(
        self, worker_id: int, generation: int, done: BatchDone, buffers: tuple[tuple[int, bytes], ...] = ()
    ) -> FinishedBatch:
        """A worker's finished batch; a slot payload is mapped and held once.

        TransportError if the slot cannot be mapped (e.g. out of file descriptors):
        the slot goes straight back to its worker (the scheduler has the batch made
        again, sent over the pipe).
        """
        if done.retired:
            self.forget(done.retired)
        if done.slot is None:
            return FinishedBatch(worker_id, generation, done, buffers)
        key = (worker_id, generation, done.slot.name)
        with self._lock:
            try:
                view = self._reader.view(done.slot, done.payload_bytes)
            except OSError as exc:
                failure: OSError | None = exc
            else:
                failure = None
                self._refs[key] = self._refs.get(key, 0) + 1
                self._held[key[:2]] = self._held.get(key[:2], 0) + 1
        if failure is not None:
            self._give_back(*key)  # unmapped, so never held: the worker may reuse it now
            raise TransportError(f"cannot map {done.slot.name}: {failure.strerror or failure}") from None
        return FinishedBatch(worker_id, generation, done, ((0, view),))

    def retain(self, batch: FinishedBatch) -> None:
        if batch.slot is None:
            return
        key = (batch.worker_id, batch.generation, batch.slot.name)
        with self._lock:
            self._refs[key] += 1

    def release(self, batch: FinishedBatch) -> None:
        if batch.slot is None:
            return
        key = (batch.worker_id, batch.generation, batch.slot.name)
        worker = key[:2]
        with self._lock:
            left = self._refs[key] - 1
            if left:
                self._refs[key] = left
                return
            del self._refs[key]
            self._held[worker] -= 1
            retiring = self._retiring.pop(worker, None) if self._held[worker] == 0 else None
            if self._held[worker] == 0:
                del self._held[worker]
        if retiring is not None:
            self._unlink(retiring)
        else:
            self._give_back(*key)

    def held(self) -> int:
        """How many slots anyone holds."""
        with self._lock:
            return len(self._refs)

    # ------------------------------------------------------------ leases

    def open_session(self, session_id: int) -> None:
        with self._lock:
            self._sessions.setdefault(session_id, _Session())

    def leases_of(self, session_id: int) -> int:
        """How many leases the session holds."""
        with self._lock:
            session = self._sessions.get(session_id)
            return len(session.leases) if session is not None else 0

    def lease(self, session_id: int, stream_token: int, batch: FinishedBatch) -> int | None:
        """Hand ``batch``'s reference to a session; None if the session or the stream is gone."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or stream_token in session.abandoned:
                return None
            lease = next(self._lease_ids)
            session.leases[lease] = (batch, stream_token)
            return lease

    def release_leases(self, session_id: int, leases: list[int]) -> None:
        """The client dropped these batches."""
        with self._lock:
            session = self._sessions.get(session_id)
            held = [session.leases.pop(lease, None) for lease in leases] if session is not None else []
        for entry in held:
            if entry is not None:
                self.release(entry[0])

    def abandon(self, session_id: int, stream_token: int, kept: list[int]) -> None:
        """The client stopped a stream: take back its leases that never became batches there."""
        keep = set(kept)
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return
            session.abandoned.add(stream_token)
            unused = [lease for lease, (_, token) in session.leases.items() if token == stream_token and lease not in keep]
            batches = [session.leases.pop(lease)[0] for lease in unused]
        for batch in batches:
            self.release(batch)

    def close_session(self, session_id: int) -> int:
        """The client is gone: every lease it held is released. Returns how many. Idempotent."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            return 0
        for batch, _ in session.leases.values():
            self.release(batch)
        return len(session.leases)

    # ------------------------------------------------------------ segments

    def retire(self, worker_id: int, generation: int, prefix: str | None) -> None:
        """Worker (``worker_id``, ``generation``) is gone: unlink its segments once none is held."""
        if prefix is None:
            return
        with self._lock:
            busy = self._held.get((worker_id, generation), 0) > 0
            if busy:
                self._retiring[(worker_id, generation)] = prefix
        if not busy:
            self._unlink(prefix)

    def forget(self, names: tuple[str, ...]) -> None:
        """A worker removed these idle segments."""
        with self._lock:
            self._reader.forget(names=names)
        self._on_retired(names, ())

    def _unlink(self, prefix: str) -> None:
        unlink_segments(prefix)
        with self._lock:
            self._reader.forget(prefix=prefix)
        self._on_retired((), (prefix,))

    def close(self) -> None:
        """Unlink every segment of this daemon (shutdown). Idempotent."""
        if self._prefix is not None:
            unlink_segments(self._prefix)
