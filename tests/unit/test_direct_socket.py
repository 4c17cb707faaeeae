"""The direct socket, both ends, in one process: DirectListener (accepting, keys, expiry, the cap, close),
DirectSocket (the daemon's side of a call's connection) and DirectConnection (the client's), over a real unix
socket: responses one way, requests the other after the switch."""

from __future__ import annotations

import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loaderd.channel.threads import SenderThread
from loaderd.server.rpc import direct_listener
from loaderd.server.rpc.direct_listener import DirectListener
from loaderd.server.rpc.direct_socket import DirectSocket, with_direct_requests
from loaderd.server.rpc.requests import BadRequestError
from loaderd.stream.direct_connection import DirectConnection
from loaderd.stream.stream_call import Progress, _request_stream
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.direct_frames import ACK, DIRECT_KEY_BYTES, DIRECT_SOCKET_SUFFIX, PREFIX, READ_BYTES, DirectClosed
from loaderd.wire.limits import SEGMENT_PREFIX, SHM_DIR

pytestmark = pytest.mark.timeout(20)


def socket_path() -> str:
    """Where a daemon's direct socket lies (a client connects to no other): beside its segments, named as theirs."""
    return os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}-{DIRECT_SOCKET_SUFFIX}")


@pytest.fixture
def listener() -> Iterator[DirectListener]:
    made = DirectListener(socket_path(), handshake_timeout=5.0)
    made.start()
    yield made
    made.close()


def connect(path: str, stop: threading.Event | None = None, requests: queue.Queue[Any] | None = None) -> DirectConnection | None:
    return DirectConnection.connect(path, requests if requests is not None else queue.Queue(), stop or threading.Event())


def attached(
    listener: DirectListener, stop: threading.Event | None = None, requests: queue.Queue[Any] | None = None
) -> tuple[DirectSocket, DirectConnection]:
    """A client's connection, claimed by the daemon's side and attached (``requests``: the call's queue for gRPC)."""
    client = connect(listener.path, stop, requests)
    assert client is not None
    conn = listener.claim(client.key, timeout=5.0)
    assert conn is not None, "the listener never handed over the connection that sent its key"
    sink = DirectSocket()
    sink.claim(conn)
    sink.attach()
    return sink, client


def always() -> bool:
    return True


def test_socket_is_private_and_goes_with_close() -> None:
    made = DirectListener(socket_path(), handshake_timeout=5.0)
    made.start()
    assert (os.stat(made.path).st_mode & 0o777) == 0o600
    made.close()
    made.close()  # idempotent
    assert not os.path.exists(made.path)
    assert connect(made.path) is None  # nothing listens: the call stays on gRPC


def test_close_does_not_wait_out_the_threads_poll() -> None:
    """A daemon's stop waits for the listener's thread: close wakes it rather than letting its select time out."""
    made = DirectListener(socket_path(), handshake_timeout=5.0)
    made.start()
    time.sleep(0.05)  # the thread is in its select (POLL_S, 0.25 s)
    started = time.monotonic()
    made.close()
    took = time.monotonic() - started
    assert took < direct_listener.POLL_S / 2, f"close took {took:.3f}s"
    made.close()  # idempotent once the wake pair is closed too


def test_responses_arrive_whole_and_in_order(listener: DirectListener) -> None:
    sink, client = attached(listener)
    # Small frames (many a read), one split across reads, and frames larger than the client's buffer.
    messages = [bytes([n % 251]) * size for n, size in enumerate([0, 1, 120, READ_BYTES - 3, 7, 3 * READ_BYTES, 5, READ_BYTES + 1])]
    messages += [b"x%d" % n for n in range(2000)]
    writer = threading.Thread(target=lambda: ([sink.send(m, always) for m in messages], sink.close()))
    writer.start()
    got = list(client.responses(lambda: True))
    writer.join(5)
    client.close()
    assert got == messages


def test_an_unknown_key_is_not_claimed_and_a_key_is_claimed_once(listener: DirectListener) -> None:
    client = connect(listener.path)
    assert client is not None
    assert listener.claim(os.urandom(DIRECT_KEY_BYTES), timeout=0.3) is None
    conn = listener.claim(client.key, timeout=5.0)
    assert conn is not None
    assert listener.claim(client.key, timeout=0.3) is None
    conn.close()
    client.close()


def test_a_connection_nobody_claims_is_closed() -> None:
    made = DirectListener(socket_path(), handshake_timeout=0.3)
    made.start()
    try:
        client = connect(made.path)
        assert client is not None
        # The daemon closes it after handshake_timeout: the client reads the end, not a hang.
        assert list(client.responses(lambda: True)) == []
        assert made.claim(client.key, timeout=0.1) is None
        client.close()
    finally:
        made.close()


def test_waiting_connections_are_capped(listener: DirectListener, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two wait for their calls; the third is closed unanswered rather than held, and its client, hearing no
    answer, offers no key: its call stays on gRPC without waiting for a claim."""
    monkeypatch.setattr(direct_listener, "MAX_WAITING", 2)
    first, second = connect(listener.path), connect(listener.path)
    assert first is not None and second is not None
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(5)
    raw.connect(listener.path)
    assert raw.recv(1) == b""  # closed at once, no answer
    raw.close()
    assert connect(listener.path) is None
    for client in (first, second):
        conn = listener.claim(client.key, timeout=5.0)
        assert conn is not None
        conn.close()
        client.close()
    assert connect(listener.path) is not None  # room again


def test_a_key_in_two_pieces_is_read_whole(listener: DirectListener) -> None:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(5)
    raw.connect(listener.path)
    key = os.urandom(DIRECT_KEY_BYTES)
    raw.sendall(key[:5])
    assert listener.claim(key, timeout=0.3) is None
    raw.sendall(key[5:])
    assert raw.recv(1) == ACK
    conn = listener.claim(key, timeout=5.0)
    assert conn is not None
    conn.close()
    raw.close()


def test_a_short_key_is_dropped(listener: DirectListener) -> None:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(listener.path)
    raw.sendall(b"short")
    raw.close()  # closed before its key was whole
    client = connect(listener.path)
    assert client is not None and listener.claim(client.key, timeout=5.0) is not None  # the listener still serves
    client.close()


def test_the_writer_hears_a_closed_client(listener: DirectListener) -> None:
    sink, client = attached(listener)
    client.close()
    with pytest.raises(DirectClosed):
        for _ in range(1000):  # the first writes may still land in the kernel's buffer
            sink.send(b"y" * 65536, always)
    sink.close()
    sink.close()  # idempotent


def test_a_writer_blocked_by_a_client_that_stopped_reading_leaves_once_unwanted(listener: DirectListener) -> None:
    sink, client = attached(listener)
    wanted = threading.Event()
    wanted.set()
    done = threading.Event()

    def write() -> None:
        while wanted.is_set():
            sink.send(b"z" * 65536, wanted.is_set)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    assert not done.wait(0.5)  # the buffers are full: it waits
    wanted.clear()
    assert done.wait(5), "the writer did not leave once its call was over"
    writer.join(5)
    sink.close()
    client.close()


def test_the_reader_leaves_on_stop(listener: DirectListener) -> None:
    stop = threading.Event()
    sink, client = attached(listener, stop)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(client.responses(lambda: not stop.is_set())))
    reader.start()
    sink.send(b"one", always)
    stop.set()
    reader.join(5)
    assert not reader.is_alive()
    assert got in ([], [b"one"])
    sink.close()
    client.close()


def test_an_oversized_frame_is_an_error(listener: DirectListener) -> None:
    sink, client = attached(listener)
    conn = sink._conn  # the raw connection: a daemon that writes garbage
    assert conn is not None
    conn.setblocking(True)
    conn.sendall(PREFIX.pack(0xFFFFFFFF))
    with pytest.raises(Exception, match="frame of 4294967295 bytes"):
        list(client.responses(lambda: True))
    sink.close()
    client.close()


# ------------------------------------------------------------------ the requests, after the switch


def plan(consumed: int) -> pb.StreamRequest:
    return pb.StreamRequest(plan=pb.PlanBatches(consumed=consumed))


def test_requests_follow_the_switch_in_order(listener: DirectListener) -> None:
    """Requests put before the switch are queued for gRPC, the switch's ``direct`` after them; later ones are
    written on the connection; the daemon reads gRPC's up to ``direct``, then the connection's."""
    requests: queue.Queue[Any] = queue.Queue()
    sink, client = attached(listener, requests=requests)
    client.put(plan(1), None)
    client.switch()
    client.put(plan(2), None)
    client.put(pb.StreamRequest(open=pb.OpenStream(dataset="next")), Progress(0))
    client.put(plan(3), None)
    queued = []
    while not requests.empty():
        queued.append(requests.get_nowait()[0])
    assert [r.WhichOneof("kind") for r in queued] == ["plan", "direct"]
    client.close()  # the client's end closes: the daemon reads to the end of what was written
    got = list(with_direct_requests(iter(queued), sink, always, 1 << 20))
    assert [(r.WhichOneof("kind"), r.plan.consumed) for r in got] == [("plan", 1), ("plan", 2), ("open", 0), ("plan", 3)]
    assert got[2].open.dataset == "next"
    sink.close()


def test_progress_goes_on_the_connection_after_the_switch(listener: DirectListener) -> None:
    sink, client = attached(listener)
    progress = Progress(0)
    client.switch()
    client.took_over(progress)  # gRPC's thread met the switch: the epoch it reported for goes on from here
    progress.consumed = 5
    client.report()
    client.report()  # nothing new: no message
    client.put(plan(7), None)
    progress.consumed = 7  # the plan said it already
    client.report()
    client.close()
    got = list(sink.requests(always, 1 << 20))
    assert [r.plan.consumed for r in got] == [5, 7]
    assert progress.reported == 7
    sink.close()


def test_the_sending_thread_meets_the_switch_while_a_write_waits_for_the_daemon(listener: DirectListener) -> None:
    """The daemon reads the connection only once gRPC brought it the ``direct`` marker: a plan written after the
    switch and larger than the socket's buffers waits for that, so gRPC's sending thread (the call's real request
    iterator) must hand out the marker while that write waits (the deadlock CI met at 8f9c5a3)."""
    stop = threading.Event()
    requests: queue.Queue[Any] = queue.Queue()
    sink, client = attached(listener, stop=stop, requests=requests)
    iterator = _request_stream(requests, stop, SenderThread(), client)
    client.switch()
    big = pb.StreamRequest(plan=pb.PlanBatches(batches=[pb.IndexBatch(indices=range(1 << 20))], consumed=1))
    writer = threading.Thread(target=client.put, args=(big, None), daemon=True)
    sent: list[pb.StreamRequest] = []
    sender = threading.Thread(target=lambda: sent.append(next(iterator)), daemon=True)
    try:
        writer.start()
        deadline = time.monotonic() + 10
        # The writer holds the connection's lock while the socket is full (the state the deadlock needs).
        while not (client._lock.locked() and writer.is_alive()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writer.is_alive() and client._lock.locked(), "the plan fit the socket's buffers: nothing here waits"
        sender.start()
        sender.join(5)
        assert [r.WhichOneof("kind") for r in sent] == ["direct"], "gRPC's sending thread waited on the write"
        got = next(sink.requests(always, big.ByteSize() + 16))  # the marker reached the daemon: it reads the plan
        writer.join(5)
        assert not writer.is_alive()
        assert got == big
    finally:
        stop.set()  # a writer still waiting leaves within a poll
        writer.join(5)
        sender.join(5)
        client.close()
        sink.close()


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (pb.StreamRequest(direct=pb.DirectRequests()).SerializeToString(), "'direct' sent on the direct connection"),
        (b"\xff\xff\xff", "malformed request"),
        (b"x" * 2000, "a frame of 2000 bytes"),
    ],
    ids=["direct-again", "garbage", "too-large"],
)
def test_bad_requests_on_the_connection_are_refused(listener: DirectListener, raw: bytes, why: str) -> None:
    sink, client = attached(listener)
    assert client._conn.send(PREFIX.pack(len(raw)) + raw) == PREFIX.size + len(raw)
    with pytest.raises(BadRequestError, match=why):
        list(sink.requests(always, 1024))
    sink.close()
    client.close()


def test_the_descriptor_is_closed_only_once_the_reader_let_go(listener: DirectListener) -> None:
    sink, client = attached(listener)
    conn = sink._conn
    assert conn is not None
    client.switch()
    client.put(plan(1), None)
    reading = sink.requests(always, 1 << 20)
    assert next(reading).plan.consumed == 1  # a reader holds the connection now
    sink.close()  # the call ends
    assert conn.fileno() != -1, "closed under a reader's feet (its number could be reused)"
    reading.close()
    assert conn.fileno() == -1
    client.close()


def test_closing_wakes_the_reader_and_closes_after_it(listener: DirectListener) -> None:
    sink, client = attached(listener)
    got: list[pb.StreamRequest] = []
    reader = threading.Thread(target=lambda: got.extend(sink.requests(always, 1 << 20)))
    reader.start()
    conn = sink._conn
    assert conn is not None
    sink.close()  # the call ends while its reader waits: it reads the end at once
    reader.join(5)
    assert not reader.is_alive() and got == []
    assert conn.fileno() == -1  # closed once the reader let go
    client.close()


def test_requests_without_a_connection_are_a_bad_request() -> None:
    with pytest.raises(BadRequestError, match="not attached"):
        list(with_direct_requests(iter([pb.StreamRequest(direct=pb.DirectRequests())]), DirectSocket(), always, 1024))


def test_a_client_connects_only_to_a_direct_socket_of_its_own_in_shared_memory(tmp_path: Path) -> None:
    """A daemon names the socket; a client writes only to one that can be a daemon's: in /dev/shm, named as a
    daemon's direct socket, a socket, of its own user (not, say, another service's socket it could reach)."""
    elsewhere = DirectListener(str(tmp_path / f"{SEGMENT_PREFIX}1-x-{DIRECT_SOCKET_SUFFIX}"), handshake_timeout=5.0)
    elsewhere.start()
    file_path = socket_path()
    Path(file_path).write_bytes(b"")
    try:
        assert connect(elsewhere.path) is None
        assert connect(file_path) is None
        assert connect(os.path.join(SHM_DIR, "not-loaderd-direct")) is None
    finally:
        elsewhere.close()
        os.unlink(file_path)
