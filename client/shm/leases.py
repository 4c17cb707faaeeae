"""Leases: the shared-memory slot leases one process holds, and those it dropped and has not given back.

A batch that arrives as a slot is ``claim``ed under its stream's token. When
the user's last tensor of it is gone (``release``, run by a finalizer), the
lease waits for a ride back to the daemon: the next message that plans
batches on its own stream takes it (``take``; protocol revision 5,
``PlanBatches.released_leases``), which spares the session call a message of
its own per batch when the loop runs faster than a period. What no plan takes
goes out on the session call, many leases to a message: the session's sender
``tick``s once a period and sends what waited a whole period (so a lease waits
one to two periods; the period backs off while plans carry everything:
``loaderd.shm.release_period``). It ticks on while anything is pending or was
released since its last tick, so in a running loop no release wakes it (in a
fast one plans take nearly every lease, and each release after a tick that
found nothing pending woke it, then its tick did again); it sleeps once a tick
finds nothing pending and no release since the tick before, and ``release``
says when it must be woken. A stream stopped early is ``abandon``ed: the
daemon takes back every lease of it except those still claimed, so its
pending ones are forgotten here.

Finalizers run wherever a garbage collection does, including on a thread in
the middle of one of these methods. So every method holds one reentrant lock
and changes the containers only by popping from them, by adding to
``_young``, or by swapping in a new one (never while iterating one that a
re-entering release could change): a release that re-enters lands in
``_young``, whichever dict that is at that moment, and is neither lost nor
sent twice.
"""

from __future__ import annotations

import threading
from typing import NamedTuple


class Tick(NamedTuple):
    """What a ``Leases.tick`` found."""

    due: list[int]  # dropped leases that waited a whole period: send them now
    pending: bool  # dropped leases wait for the next tick
    tick_on: bool  # tick again in a period (else sleep: the next release says to wake)


class Leases:
    """Claimed leases (lease -> stream token); dropped ones by token, in two generations (``_old`` waited a period)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._claimed: dict[int, int] = {}
        self._young: dict[int, list[int]] = {}
        self._old: dict[int, list[int]] = {}
        self._ticking = False  # the sender ticks on (see ``tick``): a release needs no wake
        self._released = False  # a lease was released since the last tick (taken by a plan or not)

    def claim(self, lease: int, token: int) -> None:
        """A batch of stream ``token`` lives in the slot of ``lease`` now."""
        with self._lock:
            self._claimed[lease] = token

    def release(self, lease: int) -> bool:
        """The batch of ``lease`` is gone; True if the sender sleeps and must start ticking."""
        with self._lock:
            token = self._claimed.pop(lease, 0)
            self._young.setdefault(token, []).append(lease)
            self._released = True
            wake = not self._ticking
            self._ticking = True
            return wake

    def take(self, token: int) -> list[int]:
        """Every dropped lease of stream ``token`` not yet sent (for a plan message of that stream to carry)."""
        with self._lock:
            leases = self._old.pop(token, [])
            leases.extend(self._young.pop(token, ()))
            return leases

    def tick(self) -> Tick:
        """The dropped leases that waited a whole period (to send now); the sender ticks on while anything is left
        or was released since the last tick (the loop runs: its next releases need no wake)."""
        with self._lock:
            due = self._old
            self._old = self._young
            self._young = {}
            # Whatever is pending now was released since the last tick, so that alone says whether to tick on.
            self._ticking = self._released
            self._released = False
            return Tick([lease for leases in due.values() for lease in leases], bool(self._old), self._ticking)

    def abandon(self, token: int) -> list[int]:
        """Stream ``token`` stopped early: forget its dropped leases (the daemon takes them back) and
        return those still claimed (the daemon keeps them until each is released).

        Under the one lock, so no release of another thread falls between the two. One that
        re-enters (a collection during the copy) is either not kept (the daemon takes it back, and
        its own release later finds nothing) or kept and pending, and sent."""
        with self._lock:
            self._old.pop(token, None)
            self._young.pop(token, None)
            claimed = self._claimed.copy()  # a re-entering release must not change what is iterated
            return [lease for lease, owner in claimed.items() if owner == token]

    def claimed(self) -> dict[int, int]:
        """A copy of the claimed leases (lease -> stream token)."""
        with self._lock:
            return self._claimed.copy()
