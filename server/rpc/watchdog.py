"""Watchdog: one thread that runs actions at deadlines.

The servicer arms an alarm when a long-lived call starts, to cancel it if its
first message does not come within ``limits.handshake_timeout`` (a call that
never speaks would otherwise hold its handler thread forever), and disarms it
when the message arrives. One thread serves every alarm; ``stop`` is
idempotent and joins it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("loaderd.watchdog")


class Alarm:
    """An armed deadline; ``disarm`` it when what it guards happened (idempotent)."""

    __slots__ = ("action", "fired")

    def __init__(self, action: Callable[[], None]) -> None:
        self.action: Callable[[], None] | None = action
        self.fired = False  # the deadline passed and the action ran

    def disarm(self) -> None:
        self.action = None


class Watchdog:
    """Runs each armed alarm's action once its deadline passes, unless disarmed first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Alarm]] = []
        self._order = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="loaderd-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def arm(self, seconds: float, action: Callable[[], None]) -> Alarm:
        alarm = Alarm(action)
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._order), alarm))
            self._cond.notify()
        return alarm

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    # Disarmed alarms are dropped as they reach the top.
                    while self._heap and self._heap[0][2].action is None:
                        heapq.heappop(self._heap)
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        break
                    wait = self._heap[0][0] - now if self._heap else 1.0
                    self._cond.wait(min(wait, 1.0))
                if self._stopped:
                    return
                alarm = heapq.heappop(self._heap)[2]
                action, alarm.action = alarm.action, None
                alarm.fired = True
            if action is not None:
                try:
                    action()
                except Exception:  # an action's failure must not end the watchdog
                    log.exception("watchdog action failed")
