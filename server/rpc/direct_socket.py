"""DirectSocket: one call's direct connection on the daemon's side (the format: loaderd/wire/direct_frames.py).

Owned by the call's handler (``LoaderServicer.StreamBatches``), which writes the call's responses on it once
attached and closes it when the call ends, whichever way. The call's request reader (``CallRequests``' thread)
reads the client's requests from it once the client said so (``StreamRequest.direct``: ``with_direct_requests``).

Closing: ``close`` shuts the connection down at once (a reader waiting on it wakes to its end), and its descriptor
is closed once no reader uses it (never under a reader's feet, where the number could be reused).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Generator, Iterator

import grpc

from loaderd.server.rpc.handlers import parse
from loaderd.server.rpc.requests import BadRequestError
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.direct_frames import DirectClosed, FrameTooLarge, read_frames, send_frame
from loaderd.wire.reasons import Reason, abort


class DirectSocket:
    """A call's direct connection, once attached."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: socket.socket | None = None
        self._users = 0  # the handler (from the claim) and a reader reading it
        self._closing = False
        self.attached = False  # responses go on the connection

    @property
    def claimed(self) -> bool:
        """A connection is the call's, and not closed."""
        return self._conn is not None and not self._closing

    def claim(self, conn: socket.socket) -> None:
        """``conn`` (non-blocking, claimed from the ``DirectListener``) is the call's, closed with it."""
        with self._lock:
            self._conn, self._users = conn, 1

    def attach(self) -> None:
        """From now on ``send`` writes the responses on the claimed connection (its answer went on gRPC)."""
        assert self._conn is not None
        self.attached = True

    def send(self, message: bytes, wanted: Callable[[], bool]) -> bool:
        """Write ``message`` (one serialized StreamResponse) whole. True once the kernel has it; False if ``wanted()``
        turned False while the socket was full (the frame may be cut: close the connection); ``DirectClosed`` if
        the client closed its end."""
        conn = self._conn
        assert conn is not None
        return send_frame(conn, message, wanted)

    def requests(self, wanted: Callable[[], bool], max_bytes: int) -> Iterator[pb.StreamRequest]:
        """The client's requests on the connection until it ends (closed by either side) or ``wanted()`` turns False;
        ``BadRequestError`` for one that does not parse or is longer than ``max_bytes``."""
        with self._lock:
            conn = self._conn
            if self._closing:
                return  # the call is ending anyway
            if conn is None or not self.attached:
                raise BadRequestError("'direct' on a call whose direct connection is not attached")
            self._users += 1
        try:
            for raw in read_frames(conn, wanted, max_bytes):
                request = parse(pb.StreamRequest, raw)
                if request.WhichOneof("kind") == "direct":
                    raise BadRequestError("'direct' sent on the direct connection itself")
                yield request
        except FrameTooLarge as exc:
            raise BadRequestError(f"on the direct connection: {exc}") from None
        finally:
            self._let_go()

    def close(self) -> None:
        """The call is over: shut the connection down (the client reads its end, then the call's status on gRPC).
        Idempotent."""
        with self._lock:
            if self._conn is None or self._closing:
                return
            self._closing = True
            try:
                self._conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._let_go()

    def _let_go(self) -> None:
        with self._lock:
            self._users -= 1
            conn = self._conn if self._users == 0 else None
        if conn is not None:
            conn.close()


def with_direct_requests(
    requests: Iterator[pb.StreamRequest], direct: DirectSocket, wanted: Callable[[], bool], max_bytes: int
) -> Generator[pb.StreamRequest, None, None]:
    """A call's requests: from gRPC, and after the client's ``StreamRequest.direct`` from its direct connection until
    that ends; then from gRPC again (where nothing more comes but the call's end)."""
    for request in requests:
        if request.WhichOneof("kind") != "direct":
            yield request
        else:
            yield from direct.requests(wanted, max_bytes)


def respond(messages: Generator[bytes, None, None], direct: DirectSocket, context: grpc.ServicerContext) -> Iterator[bytes]:
    """A call's responses (``messages``, closed at the end): yielded to gRPC until ``direct`` is attached, then
    written on it. gRPC no longer takes them then, so nothing else stops them once the call is over: each send
    checks the call, and a frame cut short ends the call's writing; a client that closed its end ends the call
    (UNAVAILABLE)."""
    with contextlib.closing(messages):
        for message in messages:
            if not direct.attached:
                yield message
                continue
            try:
                if not (context.is_active() and direct.send(message, context.is_active)):
                    return
            except DirectClosed as exc:
                abort(context, grpc.StatusCode.UNAVAILABLE, f"the client's direct connection closed ({exc})", Reason.UNAVAILABLE)
