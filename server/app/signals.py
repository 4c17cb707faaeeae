"""StopSignals: what SIGTERM and SIGINT ask of `loaderd serve`, relayed off the signal handler.

SIGTERM drains first (clients move away), then stops; SIGINT, or a second
SIGTERM, stops at once. ``drain``, ``stop`` and ``woken`` are the events the
serve loop and ``Daemon.drain`` wait on.

Why a relay: Python runs signal handlers on the main thread, between two of its
bytecodes, and that thread spends its life in ``woken.wait()`` (and
``stop.wait()`` while draining). ``Event.set()`` takes the lock that ``wait()``
holds around its checks, so a handler setting the event the interrupted wait
holds waits for itself forever (CPython issue 126434): the daemon then ignored
SIGTERM while its watchdog pings went on (a CI run hung in
tests/integration/test_notify.py). The handler here only puts the signal number on a
``queue.SimpleQueue``, whose ``put`` is reentrant; a thread of its own sets the
events.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
from types import FrameType

log = logging.getLogger("loaderd")

POLL_S = 0.5  # how often the relay thread re-checks that it should end
_CLOSE = 0  # not a signal: wakes the relay thread so that it ends


class StopSignals:
    """``install`` the handlers first, ``start`` the relay once the daemon has forked what it forks
    (an import check is forked before the process has any thread); ``close`` (idempotent) ends the
    relay. Signals that arrive before ``start`` wait in the queue; after ``close`` they are ignored."""

    def __init__(self) -> None:
        self.drain = threading.Event()
        self.stop = threading.Event()
        self.woken = threading.Event()
        self._received: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._relay, name="loaderd-signals", daemon=True)

    def install(self) -> None:
        """Install the handlers for SIGTERM and SIGINT (main thread only)."""
        signal.signal(signal.SIGTERM, self.handle)
        signal.signal(signal.SIGINT, self.handle)

    def start(self) -> None:
        """Start the relay thread."""
        self._thread.start()

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: nothing here may take a lock the interrupted code can hold."""
        self._received.put(signum)

    def close(self) -> None:
        """End the relay thread (a signal it already took still sets its events)."""
        self._closed.set()
        self._received.put(_CLOSE)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(POLL_S * 4)

    def _relay(self) -> None:
        while not self._closed.is_set():
            try:
                signum = self._received.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if signum == _CLOSE:
                return
            log.info("received %s", signal.Signals(signum).name)
            if signum == signal.SIGTERM and not self.drain.is_set():
                self.drain.set()
            else:
                self.stop.set()
            self.woken.set()
