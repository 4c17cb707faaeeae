"""PendingReleases: slot leases this process dropped and has not yet given back to the daemon.

A dropped batch's lease (``ShmSession.release``, run by a finalizer) waits here
for a ride: the next message that plans batches on its own stream takes it
(``take``; protocol revision 5, ``PlanBatches.released_leases``), which spares
the session call a message, and both processes a thread wake-up, per batch.
What no plan takes goes out on the session call, many leases in one message:
while anything is pending the session's sender ``tick``s once a period and
sends what waited a whole period (so a lease waits one to two periods), and
it sleeps when nothing is pending. ``add`` says when it must be woken.

Finalizers run wherever a garbage collection does, including on a thread in
the middle of one of these methods. So every method holds one reentrant lock
and changes the containers only by popping from them, or by swapping in a new
one: a release that re-enters lands in ``_young`` (whichever dict that is at
that moment) and is neither lost nor sent twice.
"""

from __future__ import annotations

import threading


class PendingReleases:
    """Dropped leases by stream token, in two generations: ``_old`` waited a whole period."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._young: dict[int, list[int]] = {}
        self._old: dict[int, list[int]] = {}
        self._ticking = False  # the sender ticks (something was pending at its last tick)

    def add(self, lease: int, token: int) -> bool:
        """Note a dropped lease of stream ``token``; True if the sender sleeps and must start ticking."""
        with self._lock:
            self._young.setdefault(token, []).append(lease)
            wake = not self._ticking
            self._ticking = True
            return wake

    def take(self, token: int) -> list[int]:
        """Every pending lease of stream ``token`` (for a plan message of that stream to carry)."""
        with self._lock:
            leases = self._old.pop(token, [])
            leases.extend(self._young.pop(token, ()))
            return leases

    def drop(self, token: int) -> None:
        """Forget stream ``token``'s leases: its abandonment gives them back at the daemon."""
        with self._lock:
            self._old.pop(token, None)
            self._young.pop(token, None)

    def tick(self) -> tuple[list[int], bool]:
        """The leases that waited a whole period (to send now), and whether to tick on."""
        with self._lock:
            due = self._old
            self._old = self._young
            self._young = {}
            self._ticking = bool(self._old)  # tick on while anything is left
            return [lease for leases in due.values() for lease in leases], self._ticking
