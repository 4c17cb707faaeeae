"""WakePipe: a coalesced "look for work now" that the scheduler's thread waits on beside the workers' pipes.

A pipe rather than a ``threading.Event``: the pool's ``poll`` waits on the workers' pipes with
``multiprocessing.connection.wait``, which takes this one too, so one wait covers both. ``wake``
(any thread) writes one byte at most until the scheduler's thread ``drain``s it: a thousand
wake-ups between two rounds cost one write.
"""

from __future__ import annotations

import multiprocessing
import os
import threading


class WakePipe:
    """The read end (``readable``) goes to the pool's ``poll``; ``wake`` and ``drain`` as above."""

    def __init__(self) -> None:
        self.readable, self._write = multiprocessing.Pipe(duplex=False)
        self._fd = self.readable.fileno()
        os.set_blocking(self._fd, False)
        self._lock = threading.Lock()
        self._woken = False

    def wake(self) -> None:
        """Make the waiting thread return (cheap; coalesced)."""
        with self._lock:
            if self._woken:
                return
            self._woken = True
        try:
            self._write.send_bytes(b"w")
        except OSError:  # closed during shutdown
            pass

    def drain(self) -> None:
        """Empty the pipe and re-arm ``wake`` (the scheduler's thread, after its wait).

        Raw non-blocking reads (the bytes mean nothing): ``Connection.poll`` would
        build a selector per call, twice a round. None at all while no ``wake`` came since the last
        drain: most rounds are the workers' results, and a read that finds nothing raises (~5% of the
        scheduler's time). ``wake`` sets the flag before it writes, so a byte in the pipe always has
        it set; one written after this look wakes the next wait, whose drain reads it."""
        if not self._woken:  # read without the lock: a stale False only leaves a byte for the next round
            return
        woken = False
        while True:
            try:
                if not os.read(self._fd, 4096):
                    break
            except BlockingIOError:
                break
            woken = True
        if woken:
            with self._lock:
                self._woken = False


