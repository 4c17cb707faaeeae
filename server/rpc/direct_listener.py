"""DirectListener: the daemon's direct socket, where same-host clients connect for their calls' responses.

The format and the handshake are in loaderd/wire/direct_frames.py. This side:

- one unix socket beside the daemon's segments (mode 0600, so only its user connects; a peer of another uid, by
  ``SO_PEERCRED``, is closed at once);
- one thread (``loaderd-direct``, owned and joined by ``close``) accepts connections and reads each one's key
  without blocking on any of them; a connection whose key is complete gets one byte back (``ACK``: the client
  offers the key only then, so a connection refused here never makes a call wait for it) and waits to be claimed;
- a call's servicer thread ``claim``s the connection by the key its client named in ``open`` (the client names it
  only once answered, so it is there; the wait, up to a timeout, is for a client that named a key it never sent);
- a connection nobody claims within ``handshake_timeout`` of its arrival is closed, and at most ``MAX_WAITING``
  wait at once (more are closed as they come, unanswered: their calls stay on gRPC): a local process of the
  daemon's user cannot hold more of the daemon's descriptors. A key that arrives twice keeps the first connection.
- if the thread fails (a bug), claims return None at once and the calls stay on gRPC.

``close`` is idempotent: it wakes the thread (a byte on a socket pair the thread also selects on), joins it, closes
every waiting connection and removes the socket's file; a daemon's stop does not wait out a poll. Claimed
connections belong to their calls (``DirectSocket``, server/rpc/direct_socket.py).
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import struct
import threading
import time

from loaderd.server.process.throttle import LogThrottle
from loaderd.wire.direct_frames import ACK, DIRECT_KEY_BYTES, POLL_S

log = logging.getLogger("loaderd.direct")

MAX_WAITING = 64
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class DirectListener:
    """Accepts direct connections and hands each to the call that names its key."""

    def __init__(self, path: str, handshake_timeout: float) -> None:
        """Binds ``path`` now (mode 0600); ``start`` begins accepting."""
        self.path = path
        self._timeout = handshake_timeout
        # ``close`` writes a byte here to end the thread's select at once. Made first: nothing else to undo if it fails.
        self._wake, self._waker = socket.socketpair()
        self._wake.setblocking(False)
        self._waker.setblocking(False)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(path)
            os.chmod(path, 0o600)  # before listen(): until then every connect is refused
            self._listener.listen(MAX_WAITING)
        except OSError:
            self._close_listener()
            self._wake.close()
            self._waker.close()
            raise
        self._listener.setblocking(False)
        self._lock = threading.Condition()
        self._reading: dict[socket.socket, tuple[float, bytearray]] = {}  # key not complete yet: arrived at, bytes
        self._ready: dict[bytes, tuple[float, socket.socket]] = {}  # key -> arrived at, connection
        self._stop = threading.Event()
        self._throttle = LogThrottle(log)
        self._thread = threading.Thread(target=self._run, name="loaderd-direct", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def claim(self, key: bytes, timeout: float) -> socket.socket | None:
        """The connection that sent ``key`` (non-blocking, now the caller's), waiting up to ``timeout`` s; None if
        none came, or the listener is closed."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._stop.is_set():
                found = self._ready.pop(key, None)
                if found is not None:
                    return found[1]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(min(left, POLL_S))
        return None

    def close(self) -> None:
        """Stop accepting, close every connection not claimed, remove the socket's file. Idempotent."""
        self._stop.set()
        try:
            self._waker.send(b"\0")
        except OSError:  # closed by an earlier close, or a byte already waits
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(POLL_S * 4)
        if not self._thread.is_alive():  # else it may still select on the pair: left to the process's exit
            self._wake.close()
            self._waker.close()
        with self._lock:
            waiting = list(self._reading) + [conn for _, conn in self._ready.values()]
            self._reading.clear()
            self._ready.clear()
            self._lock.notify_all()
        for conn in waiting:
            conn.close()
        self._close_listener()

    def _close_listener(self) -> None:
        """Close the listening socket and remove its file (a connect is then refused at once). Idempotent."""
        self._listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._wake, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(POLL_S):
                    if key.fileobj is self._wake:
                        continue  # close(): the loop sees the stop signal
                    if key.fileobj is self._listener:
                        self._accept(selector)
                    else:
                        self._read_key(selector, key.fileobj)  # type: ignore[arg-type]
                self._expire(selector)
        except Exception:  # a bug here must not leave clients waiting: they fall back to gRPC
            log.exception("the direct socket's thread failed; calls stay on gRPC")
            self._stop.set()  # claims return at once
            self._close_listener()  # and clients' connects fail at once, rather than wait for an answer
        finally:
            selector.close()

    def _accept(self, selector: selectors.BaseSelector) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of descriptors: the client falls back to gRPC
            log.warning("direct socket: cannot accept a connection: %s", exc)
            return
        try:
            _, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            conn.close()
            return
        with self._lock:
            full = len(self._reading) + len(self._ready) >= MAX_WAITING
            if uid == os.geteuid() and not full:
                conn.setblocking(False)
                self._reading[conn] = (time.monotonic(), bytearray())
                selector.register(conn, selectors.EVENT_READ)
                return
        conn.close()
        why = "too many waiting" if full else f"uid {uid}"
        self._throttle.log(logging.WARNING, why, "direct socket: a connection refused (%s); its call stays on gRPC", why)

    def _read_key(self, selector: selectors.BaseSelector, conn: socket.socket) -> None:
        with self._lock:
            entry = self._reading.get(conn)
        if entry is None:
            return
        arrived, key = entry
        try:
            data = conn.recv(DIRECT_KEY_BYTES - len(key))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        key += data
        if data and len(key) < DIRECT_KEY_BYTES:
            return
        selector.unregister(conn)
        with self._lock:
            del self._reading[conn]
            whole = bytes(key) if data and bytes(key) not in self._ready else None
            if whole is not None:
                self._ready[whole] = (arrived, conn)  # filed before the answer: the call that names it finds it
                self._lock.notify_all()
        if whole is not None:
            try:
                conn.send(ACK, socket.MSG_NOSIGNAL)  # an empty socket takes one byte at once
                return
            except OSError:
                with self._lock:
                    if self._ready.get(whole, (0.0, None))[1] is conn:
                        del self._ready[whole]
        conn.close()  # closed before its key was whole, a key already waiting, or gone before the answer

    def _expire(self, selector: selectors.BaseSelector) -> None:
        stale = time.monotonic() - self._timeout
        with self._lock:
            gone = [conn for conn, (arrived, _) in self._reading.items() if arrived < stale]
            for conn in gone:
                del self._reading[conn]
                selector.unregister(conn)
            for key in [k for k, (arrived, _) in self._ready.items() if arrived < stale]:
                gone.append(self._ready.pop(key)[1])
        for conn in gone:
            conn.close()
