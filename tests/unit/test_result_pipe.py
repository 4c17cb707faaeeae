"""The daemon's end of a worker's results pipe (server/pool/result_pipe.py) on a real pipe: a group's results from
one read, raw frames of every size after them, the long-frame header, and the pipe's end."""

from __future__ import annotations

import os
import struct
import threading
from multiprocessing.connection import Connection

import pytest

from loaderd.server.pool.result_pipe import ResultPipe
from loaderd.server.worker.result_group import ResultGroup
from loaderd.server.worker.tasks import ReplicaExhausted

pytestmark = pytest.mark.timeout(10)


def exhausted(seq: int) -> ReplicaExhausted:
    return ReplicaExhausted(stream_id=1, seq=seq)


def test_a_group_written_at_once_is_taken_from_one_read(results: tuple[Connection, Connection]) -> None:
    reader, writer = results
    pipe = ResultPipe(reader)
    assert not pipe.pending() and not pipe.whole()
    group = ResultGroup(writer, size=4)
    for seq in range(4):
        group.send(exhausted(seq), hold=True)
    assert pipe.readable() and not pipe.whole(), "in the pipe, not read yet"
    assert pipe.recv() == exhausted(0)
    assert not pipe.readable(), "the first recv read the whole group"
    assert pipe.whole() and pipe.pending()
    assert [pipe.recv() for _ in range(3)] == [exhausted(1), exhausted(2), exhausted(3)]
    assert not pipe.whole() and not pipe.pending()


def test_raw_frames_of_any_size_follow_in_order(results: tuple[Connection, Connection]) -> None:
    reader, writer = results
    pipe = ResultPipe(reader)
    large = os.urandom(3 << 20)  # far more than the pipe holds: written by a thread while read here
    sender = threading.Thread(
        target=lambda: (writer.send_bytes(b"small"), writer.send_bytes(large), writer.send_bytes(b""), ResultGroup(writer).send(exhausted(7)))
    )
    sender.start()
    assert pipe.recv_bytes() == b"small"
    assert pipe.recv_bytes() == large
    assert pipe.recv_bytes() == b""
    assert pipe.recv() == exhausted(7)
    sender.join(5)


def test_a_frame_with_the_long_length_header(results: tuple[Connection, Connection]) -> None:
    """A frame of 2 GiB or more: -1, then its length in 8 bytes (as ``Connection.send_bytes`` writes it)."""
    reader, writer = results
    pipe = ResultPipe(reader)
    os.write(writer.fileno(), struct.pack("!i", -1) + struct.pack("!Q", 5) + b"hello" + struct.pack("!i", 2))
    assert pipe.recv_bytes() == b"hello"
    assert not pipe.whole(), "two bytes of the next frame's four are not there"
    os.write(writer.fileno(), b"ok")
    assert pipe.recv_bytes() == b"ok"


def test_the_pipe_s_end_raises_eof_even_inside_a_frame(results: tuple[Connection, Connection]) -> None:
    reader, writer = results
    pipe = ResultPipe(reader)
    os.write(writer.fileno(), struct.pack("!i", 10) + b"part")
    writer.close()
    with pytest.raises(EOFError):
        pipe.recv_bytes()
    with pytest.raises(EOFError):
        pipe.recv()
