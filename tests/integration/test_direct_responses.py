"""A same-host call on the daemon's direct socket (protocol revision 8; loaderd/wire/direct_frames.py).

Against a real daemon: a shared-memory loader's call is answered ``DirectAttached(attached)`` on gRPC and reads the
rest (slot handles, inline batches, ENDs, a second epoch on the same call, a user's error) from the direct
connection, where its plans and opens go too; batches stay torch's. A connection whose key the daemon never read is answered "not attached", and the
call goes on over gRPC.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from support import datasets
from support.compare import assert_same_batches
from support.daemons import oracle_loader, running_daemon

from loaderd import RemoteDataLoader
from loaderd.server.rpc.direct_listener import DirectListener
from loaderd.stream import call_receiver, direct_connection, stream_call
from loaderd.stream.direct_connection import DirectConnection
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.direct_frames import DIRECT_KEY_BYTES, DIRECT_SOCKET_SUFFIX, send_frame
from loaderd.wire.framing import Frame, read_frame
from loaderd.wire.limits import SEGMENT_PREFIX, SHM_DIR

N = 40
BATCH = 4
WIDTH = 8192  # 128 KiB batches: shared-memory slots


def spied(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every frame the receivers read, by kind (``direct:1`` / ``direct:0`` for the answer to the offer). Frames read
    from the direct connection pass through the same ``read_frame``."""
    kinds: list[str] = []

    def spy(raw: bytes) -> Frame:
        frame = read_frame(raw)
        if frame.kind == "direct" and frame.message is not None:
            kinds.append(f"direct:{int(frame.message.direct.attached)}")
        else:
            kinds.append(frame.kind)
        return frame

    monkeypatch.setattr(call_receiver, "read_frame", spy)
    return kinds


def epochs(loader: RemoteDataLoader, count: int) -> list[list[Any]]:
    return [list(loader) for _ in range(count)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("width", [WIDTH, 2], ids=["slots", "inline"])
def test_responses_travel_on_the_direct_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    spec = {"data": {"dataset": "support.datasets:Gated", "kwargs": {"n": N, "gate": str(gate), "width": width}}}
    kinds = spied(monkeypatch)
    written: list[str] = []  # the requests the client wrote on its direct connections, by kind

    def counting(conn: socket.socket, message: bytes, wanted: Any) -> bool:
        written.append(pb.StreamRequest.FromString(message).WhichOneof("kind") or "")
        return send_frame(conn, message, wanted)

    monkeypatch.setattr(direct_connection, "send_frame", counting)
    with running_daemon(spec, prefix="ld-direct-", workers=2) as daemon:
        loader = RemoteDataLoader("data", address=daemon.address, batch_size=BATCH, num_workers=2, transport="shm")
        got = epochs(loader, 2)  # the second epoch opens on the same call
        loader.close()
        log = daemon.log()
    want = list(oracle_loader(datasets.Gated(N, str(gate), width=width), batch_size=BATCH))
    for epoch in got:
        assert_same_batches(epoch, want)
    # Every epoch's stream (the loader opens the next one ahead, too) on the one call's direct connection.
    opened = [line for line in log.splitlines() if " opened by " in line]
    assert len(opened) >= 2 and all("shared memory, direct socket" in line for line in opened), log
    # The answer comes before any batch (each call is answered once: an epoch opened ahead may take its own call).
    assert kinds[0] == "direct:1" and "direct:0" not in kinds and "end" in kinds, kinds
    # The plans after the switch, and the next epoch's open on the reused call, went there too.
    assert "plan" in written and "open" in written, written


@pytest.mark.timeout(120)
def test_a_users_error_arrives_on_the_direct_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"failing": {"dataset": "support.datasets:Failing", "kwargs": {"n": 16, "bad": [5]}}}
    kinds = spied(monkeypatch)
    with running_daemon(spec, prefix="ld-direct-err-", workers=1) as daemon:
        loader = RemoteDataLoader("failing", address=daemon.address, batch_size=4, transport="shm")
        it = iter(loader)
        next(it)
        with pytest.raises(Exception) as raised:
            next(it)
        loader.close()
    assert type(raised.value).__name__ == "ValueError" and "bad item 5" in str(raised.value), raised.value
    assert kinds[0] == "direct:1" and "error" in kinds, kinds


@pytest.mark.timeout(120)
def test_a_connection_the_daemon_never_heard_of_leaves_the_call_on_grpc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client offers a key no connection sent (its connection sent another): the daemon answers "not attached"
    within its claim's wait, and every batch comes on gRPC."""

    def wrong_key(path: str, requests: queue.Queue[Any], stop: threading.Event) -> DirectConnection | None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        conn.sendall(os.urandom(DIRECT_KEY_BYTES))
        conn.setblocking(False)
        return DirectConnection(conn, os.urandom(DIRECT_KEY_BYTES), requests, stop)

    monkeypatch.setattr(stream_call.DirectConnection, "connect", staticmethod(wrong_key))
    gate = tmp_path / "gate"
    gate.touch()
    spec = {"data": {"dataset": "support.datasets:Gated", "kwargs": {"n": N, "gate": str(gate), "width": WIDTH}}}
    kinds = spied(monkeypatch)
    with running_daemon(spec, prefix="ld-direct-no-", workers=2) as daemon:
        loader = RemoteDataLoader("data", address=daemon.address, batch_size=BATCH, num_workers=2, transport="shm")
        got = list(loader)
        loader.close()
        log = daemon.log()
    assert_same_batches(got, list(oracle_loader(datasets.Gated(N, str(gate), width=WIDTH), batch_size=BATCH)))
    assert kinds[0] == "direct:0", kinds
    assert "direct socket" not in log and "shared memory" in log, log


@pytest.mark.timeout(30)
def test_a_forked_child_closes_its_copies_of_the_direct_connections() -> None:
    """A child forked by the trainer (a DataLoader of its own, a subprocess) must not keep the daemon's end of its
    parent's calls open: the daemon sees the parent go when the parent goes."""
    path = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-{os.urandom(4).hex()}-{DIRECT_SOCKET_SUFFIX}")
    listener = DirectListener(path, handshake_timeout=5.0)
    listener.start()
    try:
        client = DirectConnection.connect(path, queue.Queue(), threading.Event())
        assert client is not None
        conn = listener.claim(client.key, timeout=5.0)
        assert conn is not None
        pid = os.fork()
        if pid == 0:  # the child: its copy is closed already
            os._exit(0 if client._conn.fileno() == -1 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child kept its copy of the parent's direct connection"
        client.close()  # the parent's, now the only one: the daemon's end reads the end at once
        conn.settimeout(5)
        assert conn.recv(1) == b""
        conn.close()
    finally:
        listener.close()
