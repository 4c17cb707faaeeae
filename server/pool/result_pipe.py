"""ResultPipe: the daemon's end of one worker's results pipe; every result a read brings, without a read each.

A worker writes its quick batches' results several in one write (server/worker/result_group.py).
``multiprocessing``'s ``Connection.recv`` reads each message with two reads of its own (its
length, then its bytes) and asks for a selector-free check between them (FIONREAD): three system
calls a result, ~12% of the daemon's time per batch on the shared-memory path (py-spy, f32 over
shared memory, 2 workers). Here one read takes whatever the pipe holds (up to ``_CHUNK``), and
the results in it are handed out from that buffer.

Rules:

- ``recv`` and ``recv_bytes`` return the next frame, reading (and blocking) until it is whole,
  as ``Connection``'s do: a worker writes a frame to its end once begun.
- ``whole`` says whether a whole frame is buffered: the pool's selector sees only the pipe, so the
  pool takes every whole frame its reads brought in the same round, and looks at ``whole`` before
  it waits (a round that failed part-way leaves some).
- ``readable`` says whether the pipe holds bytes now (one FIONREAD).
- Frames are ``multiprocessing.connection``'s: a 4-byte big-endian length (``TASK_FRAME``), or -1
  and an 8-byte one for a frame of 2 GiB or more, then the bytes. Results are unpickled with plain
  ``pickle``: they are loaderd's own dataclasses, written by its own workers.

Read by the pool's owner thread only; ``close`` closes the connection.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import struct
import termios
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TypeVar

from loaderd.server.worker.tasks import TASK_FRAME, Result

# Bytes one read asks for: a group of results (a few hundred bytes each) many times over; a larger frame (a payload
# that did not go to shared memory) is read on in pieces of its own size.
_CHUNK = 1 << 16
_LONG = struct.Struct("!Q")
_COUNT = struct.Struct("i")
_T = TypeVar("_T")


class ResultPipe:
    """The read end of a worker's results pipe (owns ``conn``)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._fd = conn.fileno()
        self._buffer = bytearray()
        self._start = 0  # the buffer's bytes before this were handed out

    def fileno(self) -> int:
        """The read end's descriptor (the pool's selector watches it)."""
        return self._fd

    def recv(self) -> Result:
        """The next result, unpickled (blocking until it is whole). EOFError at the pipe's end."""
        result: Result = self._take(pickle.loads)
        return result

    def recv_bytes(self) -> bytes:
        """The next frame's bytes (blocking until it is whole). EOFError at the pipe's end."""
        return self._take(bytes)

    def whole(self) -> bool:
        """Whether a whole frame is buffered (read already: no read needed to take it)."""
        parsed = self._header()
        return parsed is not None and len(self._buffer) - self._start >= parsed[0] + parsed[1]

    def readable(self) -> bool:
        """Whether the pipe holds bytes now (FIONREAD: one call, no selector)."""
        return bool(_COUNT.unpack(fcntl.ioctl(self._fd, termios.FIONREAD, bytes(_COUNT.size)))[0])

    def pending(self) -> bool:
        """Whether anything is there to take now: bytes buffered or in the pipe."""
        return len(self._buffer) > self._start or self.readable()

    def close(self) -> None:
        """Close the read end (what is buffered is dropped). Idempotent."""
        self._conn.close()

    def _header(self) -> tuple[int, int] | None:
        """(header bytes, frame bytes) of the next frame, if its header is buffered; None otherwise."""
        have = len(self._buffer) - self._start
        if have < TASK_FRAME.size:
            return None
        (size,) = TASK_FRAME.unpack_from(self._buffer, self._start)
        if size != -1:
            return TASK_FRAME.size, size
        if have < TASK_FRAME.size + _LONG.size:
            return None
        return TASK_FRAME.size + _LONG.size, _LONG.unpack_from(self._buffer, self._start + TASK_FRAME.size)[0]

    def _next_header(self) -> tuple[int, int]:
        """The next frame's header, read (blocking) until it is buffered. EOFError at the pipe's end."""
        self._need(TASK_FRAME.size)
        parsed = self._header()
        if parsed is None:  # a long frame's 8-byte length is still on its way
            self._need(TASK_FRAME.size + _LONG.size)
            parsed = self._header()
            assert parsed is not None
        return parsed

    def _take(self, convert: Callable[[memoryview | bytes], _T]) -> _T:
        """The next frame, whole (read on, blocking, where it is not), passed to ``convert``: a buffered one as a
        view of the buffer, where it was read (no copy of it), then handed out."""
        header, size = self._next_header()
        begin = self._start + header
        if len(self._buffer) - begin < size:
            return convert(self._rest_of_frame(begin, size))
        with memoryview(self._buffer) as view:
            value = convert(view[begin : begin + size])
        self._advance(header + size)
        return value

    def _rest_of_frame(self, begin: int, size: int) -> bytes:
        """A frame larger than what is buffered (from ``begin``): that, then the rest read in pieces as large as what
        is missing. Nothing is buffered after it."""
        pieces = [bytes(self._buffer[begin:])]
        missing = size - len(pieces[0])
        self._buffer.clear()
        self._start = 0
        while missing:
            piece = os.read(self._fd, missing)
            if not piece:
                raise EOFError("the worker's results pipe ended inside a frame")
            pieces.append(piece)
            missing -= len(piece)
        return b"".join(pieces)

    def _need(self, count: int) -> None:
        """Read until ``count`` bytes are buffered past what was handed out (blocking). EOFError at the pipe's end."""
        while len(self._buffer) - self._start < count:
            data = os.read(self._fd, max(_CHUNK, count - (len(self._buffer) - self._start)))
            if not data:
                raise EOFError("the worker's results pipe ended")
            self._buffer += data

    def _advance(self, count: int) -> None:
        self._start += count
        if self._start == len(self._buffer):
            self._buffer.clear()
            self._start = 0
        elif self._start >= _CHUNK:
            del self._buffer[: self._start]
            self._start = 0
