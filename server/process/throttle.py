"""LogThrottle: bounded logging of what clients can trigger at will.

A client can make the daemon refuse a request thousands of times a second; one
warning per refusal would fill the disk. Each kind of message is logged at most
``burst`` times per ``period`` seconds; the next line logged after a quiet spell
says how many were suppressed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any


class LogThrottle:
    """Rate-limits log lines per kind (see the module docstring)."""

    def __init__(self, logger: logging.Logger, burst: int = 20, period: float = 10.0) -> None:
        self._log = logger
        self._burst = burst
        self._period = period
        self._lock = threading.Lock()
        # kind -> (window start, lines logged in it, suppressed since the last line)
        self._kinds: dict[str, tuple[float, int, int]] = {}

    def log(self, level: int, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            start, logged, suppressed = self._kinds.get(kind, (now, 0, 0))
            if now - start >= self._period:
                start, logged = now, 0
            if logged >= self._burst:
                self._kinds[kind] = (start, logged, suppressed + 1)
                return
            self._kinds[kind] = (start, logged + 1, 0)
        if suppressed:
            message += f" ({suppressed} more like it suppressed)"
        self._log.log(level, message, *args)
