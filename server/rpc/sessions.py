"""Client sessions: the same-host proof for shared memory, and a session's life.

A client process opens one ``Session`` call per daemon. The handshake
(``SessionHost.serve``) goes:

  1. client: ``hello`` (its pid);
  2. daemon: ``challenge``, the path of a fresh 0600 file of random bytes in
     its /dev/shm (no challenge if the daemon serves no shared memory), and
     the session id;
  3. client: ``proof``, the bytes it read there (or why it could not);
  4. daemon: ``ready`` with the session id and whether shared memory is usable.

The client need not wait for ``ready``: it may name the session in streams
as soon as its proof is sent (one round trip less before a new process's
first batch). A stream that arrives first waits for the verdict
(``ClientSession.decided``), no longer than the proof's own deadline.

Only a client that read the token shares the daemon's /dev/shm, so nothing is
guessed from the address. Session ids are random (63 bits), sent only to the
session's opener, and bound to the identity that opened it (a token's name or a
certificate's; not the peer address, which every unix-socket client shares): a
stream naming a session is served through it only with the same identity
(``SessionRegistry.shm_session``), so no client can lease slots into another's
without its unguessable id. Afterwards the client sends ``release`` (batches it
dropped that no plan message carried back: ``PlanBatches.released_leases``, applied
by the servicer) and ``abandon`` (a stream it stopped) messages, and the daemon sends
``retired`` notices (segments it removed, to unmap). The session's slot leases
are kept by the ledger (server/scheduling/ledger.py). When the call ends, every lease
goes back, unless the client's process still lives on this host (it holds a lock on the
challenge file, its ``LifeMark``): then the session is *paused*, its leases kept until the
process exits or resumes it with a new call (server/rpc/liveness.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from loaderd.server.rpc.direct_listener import DirectListener
from loaderd.server.rpc.liveness import LIFE_CHECK_S, LifeMark
from loaderd.server.rpc.requests import BadRequestError
from loaderd.server.rpc.watchdog import Watchdog
from loaderd.server.scheduling.ledger import SlotLedger
from loaderd.server.security.auth import ANONYMOUS, Identity
from loaderd.server.shm.arena import create_probe
from loaderd.v1 import loaderd_pb2 as pb

log = logging.getLogger("loaderd.sessions")

# How often the session's handler re-checks that its client is still there.
_POLL_S = 0.25
# How long a call waits for the direct connection its client named (it names one only once the daemon answered it, so
# the wait is for a client that named a key it never sent).
DIRECT_CLAIM_S = 1.0


@dataclass
class ClientSession:
    """One client process's session with the daemon."""

    session_id: int
    peer: str
    identity: Identity = ANONYMOUS
    shm: bool = False
    closed: bool = False
    # Set once ``shm`` is final: the proof was checked (or none was asked for), or the session ended.
    decided: threading.Event = field(default_factory=threading.Event)
    # time.monotonic() by which the proof must arrive (the session is cut then): a stream waits no longer.
    verdict_by: float = 0.0
    # Messages for the client (segments it should unmap), sent by the session's handler; None only
    # wakes the handler (the session was closed).
    outbox: queue.Queue[pb.SessionResponse | None] = field(default_factory=queue.Queue)
    # A same-host session's challenge file, which its process keeps locked while it lives.
    mark: LifeMark | None = None
    # Which of its calls serves it (one more each time it is resumed): a former call's end ends nothing.
    call: int = 0


class SessionForeignError(Exception):
    """A stream named a session that another identity opened."""


class SessionRegistry:
    """Every open session, and every paused one (its call ended while its process lives)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[int, ClientSession] = {}
        self._paused: dict[int, ClientSession] = {}
        self._shut = False  # shutting down: no session is taken over

    def open(self, peer: str, identity: Identity = ANONYMOUS) -> ClientSession:
        with self._lock:
            session_id = 0
            while not session_id or session_id in self._sessions or session_id in self._paused:
                session_id = secrets.randbits(63)  # unguessable: ids are not handed out in order
            session = ClientSession(session_id=session_id, peer=peer, identity=identity)
            self._sessions[session_id] = session
            return session

    def open_count(self) -> int:
        with self._lock:
            return len(self._sessions)

    def paused_count(self) -> int:
        with self._lock:
            return len(self._paused)

    def pause(self, session: ClientSession) -> bool:
        """Keep ``session`` (closed: no stream is served through it) until ``take_over`` or ``unpause``;
        False once shutting down (``take_paused`` was called): it is released instead."""
        with self._lock:
            if self._shut:
                return False
            self._paused[session.session_id] = session
            return True

    def is_paused(self, session: ClientSession) -> bool:
        with self._lock:
            return self._paused.get(session.session_id) is session

    def unpause(self, session: ClientSession) -> bool:
        """Stop keeping ``session``; False if it was resumed (or let go) already."""
        with self._lock:
            return self._paused.pop(session.session_id, None) is session

    def find(self, session_id: int, identity: Identity) -> ClientSession | None:
        """The paused or open session ``session_id`` of ``identity`` (a resume's candidate), else None."""
        with self._lock:
            session = self._paused.get(session_id) or self._sessions.get(session_id)
            return session if session is not None and session.identity == identity and session.mark is not None else None

    def take_over(self, session: ClientSession, peer: str) -> int | None:
        """``session`` (paused, or still open: its old call's end not yet seen) served by a new call from
        ``peer`` whose client proved the same host again; the call's number, or None if the session was
        let go meanwhile. The old call's end, its handler and its reader then end nothing."""
        with self._lock:
            if self._paused.get(session.session_id) is session and not self._shut:
                del self._paused[session.session_id]  # its outbox kept what it missed (segments retired)
            elif self._sessions.get(session.session_id) is session and not session.closed and not self._shut:
                old, session.outbox = session.outbox, queue.Queue()
                while True:  # what the old handler has not sent yet (segments retired) goes to the new one
                    try:
                        message = old.get_nowait()
                    except queue.Empty:
                        break
                    if message is not None:
                        session.outbox.put(message)
                old.put(None)  # wake the old handler: it sees the call is no longer its own
            else:
                return None
            session.call += 1
            session.peer = peer
            session.closed = False
            session.shm = True
            session.decided.set()
            self._sessions[session.session_id] = session
            return session.call

    def set_mark(self, session: ClientSession, mark: LifeMark) -> bool:
        """Give ``session`` its mark (the previous one, if any, is removed); False if it ended meanwhile."""
        with self._lock:
            if session.closed and self._paused.get(session.session_id) is not session:
                return False
            previous, session.mark = session.mark, mark
        if previous is not None and previous.path != mark.path:
            previous.remove()
        return True

    def take_paused(self) -> list[ClientSession]:
        """Every paused session, no longer kept; none is taken over from now on (shutdown)."""
        with self._lock:
            self._shut = True
            paused, self._paused = list(self._paused.values()), {}
            return paused

    def shm_session(self, session_id: int, identity: Identity) -> ClientSession | None:
        """The open session ``session_id`` if it proved shared memory, else None; SessionForeignError
        if ``identity`` is not the one that opened it.

        A session whose proof is still on its way (its client named it right after
        sending the proof) is waited for, until the proof's own deadline at most.
        """
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.closed:
                return None
            if session.identity != identity:
                raise SessionForeignError(f"session {session_id} was opened by {session.identity}, not {identity}")
        session.decided.wait(max(0.0, session.verdict_by - time.monotonic()))
        return session if session.shm and not session.closed else None

    def close(self, session: ClientSession, call: int | None = None) -> bool:
        """Forget ``session`` (if its call is still ``call``, unless None); False if it was closed already."""
        with self._lock:
            if session.closed or (call is not None and call != session.call):
                return False
            session.closed = True
            self._sessions.pop(session.session_id, None)
        session.decided.set()  # a stream waiting for its verdict finds it closed
        session.outbox.put(None)  # its handler ends the call now, not at its next poll
        return True

    def announce_retired(self, names: tuple[str, ...], prefixes: tuple[str, ...]) -> None:
        """Tell every shared-memory client which segments are gone, so it unmaps them (a paused one once it
        resumes: its outbox waits)."""
        message = pb.SessionResponse(retired=pb.SegmentsRetired(names=names, prefixes=prefixes))
        with self._lock:
            for session in [*self._sessions.values(), *self._paused.values()]:
                if session.shm:
                    session.outbox.put(message)

    def open_sessions(self) -> list[ClientSession]:
        with self._lock:
            return list(self._sessions.values())


class SessionHost:
    """Runs the ``Session`` call: the handshake, then the client's releases until it goes away."""

    def __init__(
        self,
        registry: SessionRegistry,
        ledger: SlotLedger,
        shm_prefix: str | None,
        watchdog: Watchdog,
        proof_timeout: float,
        direct: DirectListener | None = None,
    ) -> None:
        """``proof_timeout``: seconds a client has to answer the challenge (``watchdog`` cuts the call after);
        ``direct``: the socket same-host calls' responses may travel on (server/rpc/direct_listener.py), named in
        the challenge."""
        self.registry = registry
        self._ledger = ledger
        self._shm_prefix = shm_prefix
        self._watchdog = watchdog
        self._proof_timeout = proof_timeout
        self._probes = itertools.count()
        self._direct = direct

    def claim_direct(self, key: bytes) -> socket.socket | None:
        """The direct connection that sent ``key``, now the caller's; None if there is none (in time)."""
        if self._direct is None:
            return None
        return self._direct.claim(key, min(DIRECT_CLAIM_S, self._proof_timeout))

    def end(self, session: ClientSession, call: int | None = None) -> None:
        """The session's call ``call`` ended (None: whichever it has now): every slot it held goes back to its
        worker, unless its process lives on this host (it holds its mark's lock): then the session is paused,
        its leases kept. Idempotent; a call the session was resumed from since ends nothing."""
        if not self.registry.close(session, call):
            return
        mark = session.mark
        if mark is not None and self._ledger.leases_of(session.session_id) and mark.held() and self.registry.pause(session):
            log.warning(
                "session %d (%s): the call ended but its process lives (paused or stopped?): keeping its %d leased slots "
                "until it exits or comes back",
                session.session_id,
                session.peer,
                self._ledger.leases_of(session.session_id),
            )
            self._watchdog.arm(LIFE_CHECK_S, lambda: self._check_paused(session))
            return
        self._release(session)

    def _check_paused(self, session: ClientSession) -> None:
        """On the watchdog's thread: let a paused session go once its process has exited."""
        mark = session.mark
        if mark is not None and mark.held():
            if self.registry.is_paused(session):  # else resumed (its next end checks again) or shut down
                self._watchdog.arm(LIFE_CHECK_S, lambda: self._check_paused(session))
        elif self.registry.unpause(session):
            self._release(session)

    def _release(self, session: ClientSession) -> None:
        if session.mark is not None:
            session.mark.remove()
        released = self._ledger.close_session(session.session_id)
        if released:
            log.info("session %d (%s) ended holding %d slots; released", session.session_id, session.peer, released)

    def close_all(self) -> None:
        """Shutdown: end every session (each gives back what it held, as when its client goes, paused ones
        too); the handlers of those past their handshake end their calls at once."""
        for session in self.registry.take_paused():  # first: none is taken over after this
            self._release(session)
        for session in self.registry.open_sessions():
            self.end(session)

    def serve(
        self, hello: pb.SessionHello, requests: Iterator[pb.SessionRequest], context: grpc.ServicerContext, identity: Identity
    ) -> Iterator[pb.SessionResponse]:
        """The session's responses, from the challenge on (see the module docstring).

        A call that names a session to resume (``hello.resume_session_id``: one of this identity's,
        paused or not yet seen to end) is offered its id in the challenge, and takes it over only
        once its client has proved the same host again; until then, and if it fails, the session is
        untouched (its leases stay where they are).
        """
        probe = create_probe(self._shm_prefix, next(self._probes)) if self._shm_prefix is not None else None
        # Without a challenge to prove the same host again, nothing is resumed: a new session.
        resuming = self.registry.find(hello.resume_session_id, identity) if hello.resume_session_id and probe else None
        session: ClientSession | None = None
        call = 0
        if resuming is None:
            session = self.registry.open(context.peer(), identity)
            self._ledger.open_session(session.session_id)
            opened, opened_call = session, session.call
            context.add_callback(lambda: self.end(opened, opened_call))
        try:
            if probe is None:
                assert session is not None  # nothing is resumed without a challenge
                reason = "the daemon serves no shared memory (shm_bytes_per_worker is 0 or /dev/shm is unusable)"
            else:
                path, token = probe
                if session is not None:
                    session.verdict_by = time.monotonic() + self._proof_timeout
                alarm = self._watchdog.arm(self._proof_timeout, context.cancel)
                proof = None
                kept = False
                try:
                    target = resuming if resuming is not None else session
                    assert target is not None
                    direct = self._direct.path if self._direct is not None else ""
                    yield pb.SessionResponse(challenge=pb.SessionChallenge(path=path, session_id=target.session_id, direct_socket=direct))
                    proof = next(requests, None)
                    proved = proof is not None and proof.WhichOneof("kind") == "proof" and proof.proof.token == token
                    if proved and resuming is not None:
                        taken = self.registry.take_over(resuming, context.peer())
                        if taken is None:
                            return  # let go meanwhile (its process exited): nothing to resume
                        session, call = resuming, taken
                        resumed, resumed_call = session, call
                        context.add_callback(lambda: self.end(resumed, resumed_call))
                    if proved and session is not None:
                        # The client keeps the file locked while it lives (server/rpc/liveness.py).
                        kept = self.registry.set_mark(session, LifeMark(path))
                        if not kept and resuming is not None:
                            return  # it ended meanwhile: no `ready` for it
                except (grpc.RpcError, BadRequestError):
                    return  # cut (no proof in time), gone, or garbage: the session ends
                finally:
                    alarm.disarm()
                    if not kept:
                        _unlink(path)
                if session is None or proof is None or proof.WhichOneof("kind") != "proof":
                    return  # a resume whose client did not prove the same host: the session stays as it was
                session.shm = proved
                reason = "" if session.shm else (proof.proof.problem or "the client read other bytes: not the same shared memory")
            session.decided.set()
            verdict = "yes" if session.shm else f"no ({reason})"
            log.info(
                "session %d from %s (pid %d)%s: shared memory %s; identity: %s",
                session.session_id,
                context.peer(),
                hello.pid,
                f" resumed, holding {self._ledger.leases_of(session.session_id)} leased slots" if resuming is not None else "",
                verdict,
                identity,
            )
            yield pb.SessionResponse(ready=pb.SessionReady(session_id=session.session_id, shm=session.shm, reason=reason))
            reader = threading.Thread(
                target=self._read, args=(requests, session, call), name=f"loaderd-session-{session.session_id}", daemon=True
            )
            reader.start()
            while not session.closed and session.call == call and context.is_active():
                try:
                    message = session.outbox.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if message is not None:
                    yield message
        finally:
            if session is not None:
                self.end(session, call)

    def _read(self, requests: Iterator[pb.SessionRequest], session: ClientSession, call: int) -> None:
        """Apply the client's releases until it goes away; then every slot it held goes back."""
        try:
            for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "release":
                    self._ledger.release_leases(session.session_id, list(request.release.leases))
                elif kind == "abandon":
                    abandon = request.abandon
                    self._ledger.abandon(session.session_id, abandon.stream_token, list(abandon.kept_leases))
        except grpc.RpcError:
            pass  # the client went away
        except BadRequestError as exc:
            log.warning("session %d (%s) ended: %s", session.session_id, session.peer, exc)
        finally:
            self.end(session, call)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
