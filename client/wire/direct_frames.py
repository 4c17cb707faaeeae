"""The direct socket's format (protocol revision 8): what a same-host call's responses look like off gRPC.

A client that shares the daemon's shared memory connects to the daemon's direct socket
(``SessionChallenge.direct_socket``, a unix socket of mode 0600), sends ``DIRECT_KEY_BYTES`` random bytes and names
them in its call's first ``open`` (``OpenStream.direct_key``). Once the daemon answers ``DirectAttached(attached)``
on gRPC, every later response of the call comes on that connection, and the client sends ``StreamRequest.direct``
on gRPC, after which its requests (plans, opens) go on the connection too. Each frame is a ``PREFIX`` (its length,
4 bytes little endian) and the serialized message, exactly the bytes gRPC would have carried. The daemon closes the
connection when the call ends; the call's status still arrives on gRPC.

Both sides read frames with ``read_frames`` and write them with ``send_frame``, on non-blocking sockets, waiting in
``POLL_S`` steps that re-check whether the caller still wants to (a stop signal, the call being over). Sends use
``MSG_NOSIGNAL``: a process that restored SIGPIPE's default is not killed by a peer that went.

Why: each gRPC message costs both processes a round of thread hand-offs (the servicer's send waits on the call's
condition, gRPC core's threads on both sides, the client's reading thread); a socket write is one system call and
one wake-up of the reading thread, and the requests need no hand-off to gRPC's sending thread (docs/pages/performance.md,
"A same-host call off gRPC").
"""

from __future__ import annotations

import select
import socket
import struct
from collections.abc import Callable, Iterator

DIRECT_KEY_BYTES = 16
# The daemon's answer once it has read a connection's key: the client offers the key in ``open`` only then.
ACK = b"\x01"
PREFIX = struct.Struct("<I")
# The socket's name beside the daemon's segments (``<daemon prefix>direct``): swept with them after a SIGKILL.
DIRECT_SOCKET_SUFFIX = "direct"


POLL_S = 0.25
# Received at once (many slot handles a read); a frame larger than this is read into its own buffer.
READ_BYTES = 256 << 10


class DirectClosed(Exception):
    """The other end of a direct connection is closed."""


class FrameTooLarge(Exception):
    """A frame longer than the reader accepts (the peer is broken or hostile)."""


def send_frame(conn: socket.socket, message: bytes, wanted: Callable[[], bool]) -> bool:
    """Write ``message`` as one frame, whole. True once the kernel has it; False if ``wanted()`` turned False
    while the socket was full (the frame may be cut: the connection is done for); ``DirectClosed`` if the other
    end is closed."""
    parts = [memoryview(PREFIX.pack(len(message))), memoryview(message)]
    poll: select.poll | None = None
    while parts:
        try:
            sent = conn.sendmsg(parts, (), socket.MSG_NOSIGNAL)  # a closed peer is an error, never SIGPIPE
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:  # EPIPE, ECONNRESET, EBADF
            raise DirectClosed(str(exc)) from None
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts:
            parts[0] = parts[0][sent:]
            if poll is None:
                poll = select.poll()
                poll.register(conn, select.POLLOUT)
            while not poll.poll(POLL_S * 1000):
                if not wanted():
                    return False
    return True


def read_frames(conn: socket.socket, wanted: Callable[[], bool], max_bytes: int) -> Iterator[bytes]:
    """Each frame's message until the other end closes the connection, or ``wanted()`` is False after ``POLL_S``
    without a byte. ``FrameTooLarge`` for a frame over ``max_bytes``."""
    poll = select.poll()
    poll.register(conn, select.POLLIN)
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    start = end = 0  # the bytes received and not yet handed out: buf[start:end]
    while True:
        # Whole frames first: one read often carries several.
        while end - start >= PREFIX.size:
            (size,) = PREFIX.unpack_from(buf, start)
            if size > max_bytes:
                raise FrameTooLarge(f"a frame of {size} bytes (at most {max_bytes})")
            if end - start - PREFIX.size < size:
                break
            yield bytes(view[start + PREFIX.size : start + PREFIX.size + size])
            start += PREFIX.size + size
        if start == end:
            start = end = 0
        elif end - start >= PREFIX.size:  # a frame not whole yet
            (size,) = PREFIX.unpack_from(buf, start)
            if PREFIX.size + size > len(buf):  # larger than the buffer: its own, filled in place
                frame = bytearray(size)
                have = end - start - PREFIX.size
                frame[:have] = view[start + PREFIX.size : end]
                target = memoryview(frame)
                while have < size:
                    got = _read_into(conn, target[have:], poll, wanted)
                    if got == 0:
                        return
                    have += got
                start = end = 0
                yield bytes(frame)
                continue
        if len(buf) - end < READ_BYTES // 4 and start > 0:  # little room at the end: move what is left to the front
            view[: end - start] = view[start:end]
            start, end = 0, end - start
        got = _read_into(conn, view[end:], poll, wanted)
        if got == 0:
            return
        end += got


def _read_into(conn: socket.socket, target: memoryview, poll: select.poll, wanted: Callable[[], bool]) -> int:
    """Bytes received into ``target``; 0 once the connection is closed, or no longer ``wanted()`` (asked only
    after ``POLL_S`` without a byte: a frame arriving costs no check)."""
    while True:
        try:
            return conn.recv_into(target)
        except (BlockingIOError, InterruptedError):
            if not poll.poll(POLL_S * 1000) and not wanted():
                return 0
        except OSError:
            return 0
