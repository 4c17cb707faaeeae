"""Drain: what a SIGTERM'd daemon tells its clients before it stops.

Draining is the first half of a graceful stop (``Daemon.drain``): health says
NOT_SERVING, new streams and lookups are refused UNAVAILABLE, and every open
stream gets one ``Draining`` message, upon which a client that can reach
another daemon moves its outstanding batches there. Streams still open keep
being served until they close or the drain's deadline passes; then the
shutdown protocol (``Daemon.shutdown``) runs. The flag only ever goes on.
"""

from __future__ import annotations

import threading
import time


class DrainSignal:
    """Set once, when the daemon begins to drain; read by the servicer's handlers."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._deadline = 0.0

    def begin(self, timeout: float) -> None:
        """Start draining; the daemon stops ``timeout`` seconds from now at the latest. Idempotent."""
        if not self._event.is_set():
            self._deadline = time.monotonic() + timeout
            self._event.set()

    @property
    def active(self) -> bool:
        return self._event.is_set()

    def stop_in(self) -> float:
        """Seconds left until the daemon stops (0 if not draining)."""
        return max(0.0, self._deadline - time.monotonic()) if self.active else 0.0
