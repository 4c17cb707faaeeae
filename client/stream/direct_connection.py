"""DirectConnection: a call's connection to its daemon's direct socket (the format: loaderd/wire/direct_frames.py).

``StreamCall`` connects one when its session names a direct socket, offers its key in the call's first ``open``,
and sends every request through ``put``. Its ``CallReceiver`` reads the call's responses from here once the daemon
answered ``DirectAttached(attached)``, and ``switch``es the requests over: a ``StreamRequest.direct`` is queued for
gRPC's sending thread (so every request queued before it reaches the daemon first), and every request ``put`` after
it is written on the connection by the thread that puts it, with no hand-off to gRPC's thread. That thread then only
reports the caller's progress (``report``) every ``PROGRESS_S``. The receiver closes the connection when it leaves.

The lock orders the switch against ``put``s and writes against ``close``: a write that waits on a full socket
re-checks the call's stop signal every ``POLL_S``. The progress has a lock of its own, and gRPC's sending thread
takes only that one before it sends the ``direct`` marker: a write after the switch may wait for the daemon to read
the socket, which the daemon does only once that marker reached it.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import stat
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from loaderd.errors import LoaderdError
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.direct_frames import ACK, DIRECT_KEY_BYTES, DIRECT_SOCKET_SUFFIX, POLL_S, DirectClosed, FrameTooLarge, read_frames, send_frame
from loaderd.wire.limits import MAX_MESSAGE_BYTES, SHM_DIR, is_segment_name

if TYPE_CHECKING:
    from loaderd.stream.stream_call import Progress

log = logging.getLogger("loaderd.direct")

# A queued request, with the ``Progress`` of the epoch it opens (None: not an ``open``); None ends the requests.
Queued = tuple[pb.StreamRequest, "Progress | None"]


class DirectConnection:
    """A connected direct socket whose key has been sent."""

    def __init__(self, conn: socket.socket, key: bytes, requests: queue.Queue[Queued | None], stop: threading.Event) -> None:
        """``requests``: the call's queue for gRPC's sending thread; ``stop``: the call's stop signal."""
        self.key = key
        self._conn = conn
        self._requests = requests
        self._stop = stop
        self._lock = threading.Lock()  # writes; then, if both, the progress lock
        self._progress_lock = threading.Lock()  # self._progress and its fields, once switched
        self._fd_lock = threading.Lock()  # orders wake() (no writer lock: a writer may hold that) against close()
        self._switched = False
        self._closed = False
        self._progress: Progress | None = None  # once switched: the epoch opened last (its progress goes from here)

    @classmethod
    def connect(cls, path: str, requests: queue.Queue[Queued | None], stop: threading.Event) -> DirectConnection | None:
        """Connect to ``path``, send a fresh key and wait (at most ``POLL_S``) for the daemon to say it read it; None
        if any of that fails, or ``path`` is not a direct socket of this user's in the shared memory (the call
        stays on gRPC)."""
        why = _not_a_direct_socket(path)
        if why:
            log.warning("the daemon named %r as its direct socket: %s; the call stays on gRPC", path, why)
            return None
        key = os.urandom(DIRECT_KEY_BYTES)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(POLL_S)  # a unix connect, 16 bytes into an empty buffer and the answer: bounded
            conn.connect(path)
            conn.sendall(key, socket.MSG_NOSIGNAL)
            if conn.recv(len(ACK)) != ACK:
                raise OSError("the daemon closed the connection (too many waiting?)")
        except OSError as exc:
            conn.close()
            log.debug("no direct connection to %s (%s): the call stays on gRPC", path, exc)
            return None
        conn.setblocking(False)
        made = cls(conn, key, requests, stop)
        _open.add(made)
        return made

    def responses(self, wanted: Callable[[], bool]) -> Iterator[bytes]:
        """Each response (a serialized StreamResponse) until the daemon closes the connection, or ``wanted()`` is
        False when none came for ``POLL_S`` (on the receiver's thread: the call stopped, or its gRPC call ended)."""
        try:
            yield from read_frames(self._conn, wanted, MAX_MESSAGE_BYTES)
        except FrameTooLarge as exc:
            raise LoaderdError(f"the daemon's direct connection sent {exc}") from None

    def switch(self) -> None:
        """The daemon attached the connection: the requests follow (on the receiver's thread, once)."""
        with self._lock:
            self._requests.put((pb.StreamRequest(direct=pb.DirectRequests()), None))
            self._switched = True

    def put(self, request: pb.StreamRequest, opens: Progress | None) -> None:
        """Send ``request`` (``opens``: the progress of the epoch it opens): queued for gRPC before the switch,
        written on the connection after it."""
        with self._lock:
            if not self._switched:
                self._requests.put((request, opens))
                return
            with self._progress_lock:
                if opens is not None:
                    self._progress = opens
                elif self._progress is not None:
                    self._progress.sent(request)
            self._write(request)

    def took_over(self, progress: Progress | None) -> None:
        """gRPC's sending thread met the switch: ``progress`` (the epoch it reported for) goes on from here, unless
        an epoch opened since. Never waits on a write (the daemon reads the socket only after this thread sent
        the marker)."""
        with self._progress_lock:
            if self._progress is None:
                self._progress = progress

    def report(self) -> None:
        """Send the caller's progress, if no message has said it yet (gRPC's sending thread, after the switch)."""
        with self._lock:
            with self._progress_lock:
                report = self._progress.report() if self._progress is not None else None
            if report is not None:
                self._write(report)

    def _write(self, request: pb.StreamRequest) -> None:
        if self._closed:
            return  # the call is over
        try:
            whole = send_frame(self._conn, request.SerializeToString(), self._wanted)
        except DirectClosed:
            whole = False  # the daemon ended the call: the receiver hears how on gRPC
        if not whole:
            self._closed = True  # a frame may be cut: nothing more is written after it

    def _wanted(self) -> bool:
        return not self._stop.is_set()

    def wake(self) -> None:
        """Shut the connection down (the call is cancelled): a thread reading it reads its end at once, one writing
        it stops. Takes no lock (a writer may hold it); the receiver still closes it."""
        with self._fd_lock:  # not while close() lets the descriptor's number go (it could name another by then)
            try:
                self._conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed already

    def close(self) -> None:
        """Close the connection (after the call's stop signal is set, or when the daemon did not attach it: the
        requests then stay on gRPC). Idempotent."""
        with self._lock, self._fd_lock:
            self._closed = True
            self._conn.close()


def _not_a_direct_socket(path: str) -> str:
    """Why ``path`` cannot be a daemon's direct socket for this process ("" if it can): a client writes only to
    a socket of its own user, named as a daemon's, in the shared memory it proved it shares."""
    if os.path.dirname(path) != SHM_DIR or not is_segment_name(os.path.basename(path)) or not path.endswith(DIRECT_SOCKET_SUFFIX):
        return f"not a loaderd direct socket in {SHM_DIR}"
    try:
        st = os.lstat(path)
    except OSError as exc:
        return exc.strerror or str(exc)
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        return "not a socket of this user's"
    return ""


# Every connection of this process, so that a forked child closes its copies (the parent's calls end when the
# parent goes, not when its last child does).
_open: weakref.WeakSet[DirectConnection] = weakref.WeakSet()


def _close_parents_connections() -> None:
    for connection in list(_open):
        connection._closed = True  # no lock: a parent's thread may have held it at the fork
        connection._conn.close()
    _open.clear()


os.register_at_fork(after_in_child=_close_parents_connections)
