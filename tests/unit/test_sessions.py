"""Sessions: a stream may name its session before the daemon's ``ready`` (protocol revision 3).

The registry's side against its own objects; the client's side (``ShmSession``)
against a scripted ``Session`` servicer in a real gRPC server on a unix socket,
which answers as a revision-3 daemon (the id comes with the challenge) or an
older one (the id comes with ``ready``).
"""

from __future__ import annotations

import os
import queue
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from support.daemons import ends_on_its_own_thread, wait_for

from loaderd.errors import LoaderdError
from loaderd.server.rpc import sessions
from loaderd.server.rpc.liveness import LifeMark
from loaderd.server.rpc.sessions import ClientSession, SessionForeignError, SessionHost, SessionRegistry
from loaderd.server.rpc.watchdog import Watchdog
from loaderd.server.scheduling.ledger import SlotLedger
from loaderd.server.security.auth import ANONYMOUS, Identity
from loaderd.shm.session import ShmSession
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.v1 import loaderd_pb2_grpc as pb_grpc
from loaderd.wire.limits import PROTOCOL_REVISION, SEGMENT_PREFIX, SHM_DIR

pytestmark = pytest.mark.timeout(30)


# ------------------------------------------------------------------ the registry


def _opened(registry: SessionRegistry, identity: Identity = ANONYMOUS, proof_within: float = 10.0) -> ClientSession:
    """A session whose challenge went out just now (as SessionHost.serve sets it)."""
    session = registry.open("peer", identity)
    session.verdict_by = time.monotonic() + proof_within
    return session


def test_a_stream_waits_for_the_verdict_of_a_session_named_early() -> None:
    registry = SessionRegistry()
    session = _opened(registry)
    found: queue.Queue[object] = queue.Queue()
    waiter = threading.Thread(target=lambda: found.put(registry.shm_session(session.session_id, ANONYMOUS)))
    waiter.start()
    time.sleep(0.1)  # the waiter must still be waiting: no verdict yet
    assert found.empty()
    session.shm = True
    session.decided.set()
    waiter.join(5)
    assert found.get_nowait() is session


def test_a_session_that_ends_before_its_verdict_wakes_the_stream_waiting_for_it() -> None:
    registry = SessionRegistry()
    session = _opened(registry)
    found: queue.Queue[object] = queue.Queue()
    started = time.monotonic()
    waiter = threading.Thread(target=lambda: found.put(registry.shm_session(session.session_id, ANONYMOUS)))
    waiter.start()
    assert registry.close(session)
    waiter.join(5)
    assert found.get_nowait() is None
    assert time.monotonic() - started < 5


def test_the_wait_ends_at_the_proof_s_deadline_and_foreign_or_unknown_sessions_are_not_waited_for() -> None:
    registry = SessionRegistry()
    session = _opened(registry, Identity("alice"), proof_within=0.3)
    started = time.monotonic()
    assert registry.shm_session(session.session_id, Identity("alice")) is None  # no proof came
    assert 0.2 < time.monotonic() - started < 5
    assert registry.shm_session(session.session_id, Identity("alice")) is None  # past the deadline: no wait at all
    later = _opened(registry, Identity("alice"))
    started = time.monotonic()
    with pytest.raises(SessionForeignError):
        registry.shm_session(later.session_id, Identity("mallory"))
    assert registry.shm_session(later.session_id + 1, Identity("alice")) is None
    assert time.monotonic() - started < 1


class _Context:
    """What SessionHost.serve asks of a grpc.ServicerContext."""

    def peer(self) -> str:
        return "unix:"

    def add_callback(self, callback: object) -> bool:
        return True  # the test ends the session itself (close_all)

    def is_active(self) -> bool:
        return True

    def cancel(self) -> None:
        raise AssertionError("nothing here should cut the call")


def _waits_on_queue(thread: threading.Thread) -> bool:
    """Whether ``thread`` is blocked in a queue.Queue.get (seen from its current stack)."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == "get" and frame.f_code.co_filename == queue.__file__:
            return True
        frame = frame.f_back
    return False


def _marked(registry: SessionRegistry, tmp_path: Path, identity: Identity = ANONYMOUS) -> ClientSession:
    session = registry.open("peer", identity)
    mark = tmp_path / f"mark-{session.session_id}"
    mark.write_bytes(b"token")
    assert registry.set_mark(session, LifeMark(str(mark)))
    session.shm = True
    return session


def test_a_paused_session_is_taken_over_by_its_identity_only_and_its_old_call_ends_nothing(tmp_path: Path) -> None:
    registry = SessionRegistry()
    me = Identity("me")
    session = _marked(registry, tmp_path, me)
    first_call = session.call
    assert registry.close(session, first_call)
    registry.pause(session)
    assert registry.paused_count() == 1 and registry.open_count() == 0
    assert registry.find(session.session_id, Identity("other")) is None  # another identity's: not offered
    assert registry.find(session.session_id, me) is session
    call = registry.take_over(session, "new peer")
    assert call == first_call + 1 and registry.paused_count() == 0 and registry.open_count() == 1
    assert not registry.close(session, first_call), "the old call's end must not close the resumed session"
    assert registry.take_over(session, "again") == call + 1  # a session still open (its old call's end unseen) too
    assert registry.close(session, call + 1)
    assert registry.take_over(session, "late") is None  # let go: nothing to take over


def test_a_mark_given_to_a_session_that_ended_meanwhile_is_refused(tmp_path: Path) -> None:
    registry = SessionRegistry()
    session = registry.open("peer")
    registry.close(session)
    assert not registry.set_mark(session, LifeMark(str(tmp_path / "late")))  # the caller removes the file


def test_a_life_mark_is_held_while_a_process_holds_its_lock_and_only_a_missing_file_says_no(tmp_path: Path) -> None:
    import fcntl

    path = tmp_path / "mark"
    path.write_bytes(b"token")
    mark = LifeMark(str(path))
    assert not mark.held()
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        assert mark.held()
    finally:
        os.close(fd)  # the process "exits": its lock goes with its descriptor
    assert not mark.held()
    mark.remove()
    assert not mark.held() and not path.exists()


def test_closing_every_session_ends_their_calls_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shutdown closes sessions before the gRPC server's grace period: a session's call, which lasts as
    long as its client, must end then, not at the handler's next poll (made a minute long here)."""
    monkeypatch.setattr(sessions, "_POLL_S", 60.0)
    registry = SessionRegistry()
    ledger = SlotLedger(None, give_back=lambda *_: None, on_retired=registry.announce_retired)
    host = SessionHost(registry, ledger, None, Watchdog(), proof_timeout=5.0)
    client_gone = threading.Event()

    def requests() -> Iterator[pb.SessionRequest]:  # a client that stays, sending nothing
        client_gone.wait(30)
        yield from ()

    try:
        responses = host.serve(pb.SessionHello(protocol_revision=PROTOCOL_REVISION, pid=os.getpid()), requests(), _Context(), ANONYMOUS)  # type: ignore[arg-type]
        ready = next(responses)  # no shared memory served here: no challenge, the verdict at once
        assert ready.WhichOneof("kind") == "ready" and not ready.ready.shm
        rest: queue.Queue[list[pb.SessionResponse]] = queue.Queue()
        handler = threading.Thread(target=lambda: rest.put(list(responses)), daemon=True)
        handler.start()
        wait_for(lambda: _waits_on_queue(handler), 10, "the session's handler to wait for news for its client")
        assert registry.open_count() == 1
        host.close_all()
        handler.join(10)
        assert not handler.is_alive(), "the session's call did not end when its session closed"
        assert rest.get_nowait() == [] and registry.open_count() == 0
    finally:
        client_gone.set()


# ------------------------------------------------------------------ the client


class _ScriptedDaemon(pb_grpc.LoaderServicer):
    """Session only: a challenge (with or without the id), then ``ready`` once ``release`` is set."""

    def __init__(self, probe: str, with_id: bool, shm_verdict: bool) -> None:
        self.probe = probe
        self.with_id = with_id
        self.shm_verdict = shm_verdict
        self.release = threading.Event()
        self.proofs: queue.Queue[pb.SessionProof] = queue.Queue()

    def Session(self, request_iterator: Iterator[pb.SessionRequest], context: grpc.ServicerContext) -> Iterator[pb.SessionResponse]:
        next(request_iterator)  # hello
        yield pb.SessionResponse(challenge=pb.SessionChallenge(path=self.probe, session_id=42 if self.with_id else 0))
        self.proofs.put(next(request_iterator).proof)
        self.release.wait(10)
        reason = "" if self.shm_verdict else "the client read other bytes"
        yield pb.SessionResponse(ready=pb.SessionReady(session_id=42, shm=self.shm_verdict, reason=reason))
        for _ in request_iterator:  # the client's releases, until it goes
            pass


@pytest.fixture
def scripted(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[_ScriptedDaemon, pb_grpc.LoaderStub]]:
    with_id, shm_verdict, probe = request.param  # probe None: make a real daemon's kind of file
    if probe is None:  # a loaderd name in /dev/shm
        probe = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}test-{os.getpid()}-{secrets.token_hex(4)}-probe-0")
        with open(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "wb") as f:
            f.write(b"x" * 32)
        request.addfinalizer(lambda: os.unlink(probe))
    daemon = _ScriptedDaemon(probe, with_id, shm_verdict)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_LoaderServicer_to_server(daemon, server)
    address = f"unix://{tmp_path / 's.sock'}"
    server.add_insecure_port(address)
    server.start()
    channel = grpc.insecure_channel(address)
    try:
        yield daemon, pb_grpc.LoaderStub(channel)
    finally:
        daemon.release.set()
        channel.close()
        server.stop(0).wait(5)


@pytest.mark.parametrize("scripted", [(True, True, None)], indirect=True)
def test_a_revision_3_session_is_usable_before_ready(scripted: tuple[_ScriptedDaemon, pb_grpc.LoaderStub]) -> None:
    daemon, stub = scripted
    session = ShmSession(stub, "scripted", handshake_timeout=10.0)  # returns although `ready` is withheld
    try:
        assert (session.session_id, session.shm, session.reason) == (42, True, "")
        assert daemon.proofs.get(timeout=5).token == b"x" * 32
        daemon.release.set()
        assert session.alive and session.shm
    finally:
        session.close()
    assert not session.alive, "close() joins the session's watcher thread, not only the process's exit"


@pytest.mark.parametrize("scripted", [(True, False, None)], indirect=True)
def test_a_daemon_that_disagrees_later_turns_the_session_off(scripted: tuple[_ScriptedDaemon, pb_grpc.LoaderStub]) -> None:
    daemon, stub = scripted
    session = ShmSession(stub, "scripted", handshake_timeout=10.0)
    try:
        assert session.shm
        daemon.release.set()
        wait_for(lambda: not session.shm, 5, "the daemon's verdict to reach the session")
        assert session.reason == "the client read other bytes"
    finally:
        session.close()


@pytest.mark.parametrize("scripted", [(False, True, None)], indirect=True)
def test_an_older_daemon_s_session_is_refused(scripted: tuple[_ScriptedDaemon, pb_grpc.LoaderStub]) -> None:
    """A challenge without an id comes from a daemon of an older protocol revision: refused at once, naming it."""
    _, stub = scripted
    with pytest.raises(LoaderdError, match="loaderd at scripted runs an older loaderd"):
        ShmSession(stub, "scripted", handshake_timeout=10.0)


@pytest.mark.parametrize("scripted", [(True, True, "/etc/hostname"), (True, True, f"{SHM_DIR}/../etc/hostname")], indirect=True)
def test_a_challenge_naming_a_file_outside_the_daemon_s_shared_memory_is_not_read(
    scripted: tuple[_ScriptedDaemon, pb_grpc.LoaderStub],
) -> None:
    """What the client reads goes back to the daemon: a daemon must not make it read one of its files."""
    daemon, stub = scripted
    session = ShmSession(stub, "scripted", handshake_timeout=10.0)
    try:
        proof = daemon.proofs.get(timeout=5)
        assert proof.token == b"" and "not a loaderd file" in proof.problem
        assert not session.shm and "not a loaderd file" in session.reason
    finally:
        session.close()


@pytest.mark.parametrize("scripted", [(True, True, None)], indirect=True)
@pytest.mark.timeout(30)
def test_a_release_on_the_thread_that_holds_the_session_s_lock_does_not_deadlock(
    scripted: tuple[_ScriptedDaemon, pb_grpc.LoaderStub],
) -> None:
    # What a garbage collection inside abandon() (or lease_view) does: a dead batch's finalizer
    # runs release() on the thread holding the lock. On a thread of its own, so that a
    # deadlock fails the test instead of hanging it.
    daemon, stub = scripted
    session = ShmSession(stub, "scripted", handshake_timeout=10.0)
    try:
        daemon.release.set()
        session._leases.claim(7, 1)
        session._leases.claim(8, 2)

        def scenario() -> None:
            with session._leases._lock:
                session.release(7)

        ends_on_its_own_thread(scenario, 10, "a release waited for the lock its own thread holds")
        assert session._leases.claimed() == {8: 2}
    finally:
        session.close()
