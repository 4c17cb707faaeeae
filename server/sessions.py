"""ShmSession: a client process's leases on shared-memory slots.

On a shared-memory stream a batch's payload stays in its worker's segment and
the client maps it; the segment is leased to the client's session until the
client releases it (its last reference to the batch is gone) or the session
ends (the client closed its channel, crashed or was killed). Only then does the
worker get the segment back, so a batch a user keeps never changes under it.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from dataclasses import dataclass, field

from loaderd.server.arena import create_probe
from loaderd.server.pool import WorkerPool, WorkerResult
from loaderd.v1 import loaderd_pb2 as pb

log = logging.getLogger("loaderd.sessions")


@dataclass
class ShmSession:
    session_id: int
    peer: str
    shm: bool = False
    # lease -> (the batch's result, the stream token it was sent on)
    leases: dict[int, tuple[WorkerResult, int]] = field(default_factory=dict)
    abandoned: set[int] = field(default_factory=set)
    closed: bool = False
    # Messages for the client (segments it should unmap), sent by the session's handler.
    outbox: queue.Queue[pb.SessionResponse] = field(default_factory=queue.Queue)


class SessionRegistry:
    """Every open session and the slots each one holds."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self._lock = threading.Lock()
        self._sessions: dict[int, ShmSession] = {}
        self._session_ids = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._probes = itertools.count()

    def open(self, peer: str) -> ShmSession:
        with self._lock:
            session = ShmSession(session_id=next(self._session_ids), peer=peer)
            self._sessions[session.session_id] = session
            return session

    def open_count(self) -> int:
        with self._lock:
            return len(self._sessions)

    def challenge(self) -> tuple[str, bytes] | None:
        """A probe file for the client to read, or None if the daemon serves no shared memory."""
        if self.pool.shm_prefix is None:
            return None
        return create_probe(self.pool.shm_prefix, next(self._probes))

    @staticmethod
    def finish_challenge(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def get(self, session_id: int) -> ShmSession | None:
        with self._lock:
            session = self._sessions.get(session_id)
            return session if session is not None and session.shm and not session.closed else None

    def lease(self, session: ShmSession, result: WorkerResult, stream_token: int) -> int | None:
        """Hand a slot to the session; None if the session or stream is gone (the caller sends bytes instead)."""
        with self._lock:
            if session.closed or stream_token in session.abandoned:
                return None
            lease = next(self._lease_ids)
            session.leases[lease] = (result, stream_token)
            return lease

    def release(self, session: ShmSession, leases: list[int]) -> None:
        with self._lock:
            held = [session.leases.pop(lease, None) for lease in leases]
        for entry in held:
            if entry is not None:
                self.pool.release(entry[0])

    def abandon(self, session: ShmSession, stream_token: int, kept: list[int]) -> None:
        """The client stopped a stream: take back its leases that the client never used."""
        keep = set(kept)
        with self._lock:
            session.abandoned.add(stream_token)
            unused = [lease for lease, (_, token) in session.leases.items() if token == stream_token and lease not in keep]
            results = [session.leases.pop(lease)[0] for lease in unused]
        for result in results:
            self.pool.release(result)

    def close(self, session: ShmSession) -> None:
        """The client is gone: every slot it held goes back to its worker. Idempotent."""
        with self._lock:
            if session.closed:
                return
            session.closed = True
            self._sessions.pop(session.session_id, None)
            results = [result for result, _ in session.leases.values()]
            session.leases.clear()
        if results:
            log.info("session %d (%s) ended holding %d slots; released", session.session_id, session.peer, len(results))
        for result in results:
            self.pool.release(result)

    def retired(self, names: tuple[str, ...], prefixes: tuple[str, ...]) -> None:
        """Tell every shared-memory client which segments are gone, so it unmaps them."""
        message = pb.SessionResponse(retired=pb.SegmentsRetired(names=names, prefixes=prefixes))
        with self._lock:
            for session in self._sessions.values():
                if session.shm:
                    session.outbox.put(message)

    def close_all(self) -> None:
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            self.close(session)
