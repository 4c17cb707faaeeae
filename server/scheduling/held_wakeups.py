"""HeldWakeups: a servicer waiting for its stream's next batch is woken when the scheduler's round ends, not mid-round.

The scheduler's thread handles a round's results under its lock, one by one, then dispatches and waits for the pool.
A servicer woken as soon as its batch is resolved wakes into a thread that still holds the lock and the GIL: it
blocks on them at once and is woken a second time when they come free (bench profile_path.py: the daemon's
``loaderd-rpc`` threads woke 2.06 times a batch, f32 over shared memory, 2 workers). Held until the scheduler is
about to wait, the wake-up finds both free: 1.53 times a batch.

The rules (every method under the scheduler's lock, which the streams' conditions share):

* ``hold`` when the scheduler's thread starts handling what the pool sent: wake-ups asked from then on are held;
* ``wake_held`` before it waits again, whatever happened in between (a round that failed too): the held ones are
  woken, and later ones are woken at once until the next ``hold``;
* so a held wake-up waits at most for the rest of one round, and one asked while the scheduler waits (a servicer's
  thread resolving a shared job's buffered batch, a test driving ``step``) is never held.
"""

from __future__ import annotations

from typing import Protocol


class Waiter(Protocol):
    """A stream as its servicer waits on it."""

    def notify_waiters(self) -> None: ...


class HeldWakeups:
    """The wake-ups held during one round of the scheduler."""

    def __init__(self) -> None:
        self._held: list[Waiter] = []
        self._holding = False

    def hold(self) -> None:
        """The scheduler's round begins: hold wake-ups from now."""
        self._holding = True

    def wake(self, waiter: Waiter) -> None:
        """Wake ``waiter``'s servicer: at the round's end, or now between rounds."""
        if self._holding:
            self._held.append(waiter)
        else:
            waiter.notify_waiters()

    def wake_held(self) -> None:
        """The scheduler is about to wait: wake what was held, and wake at once until the next ``hold``."""
        self._holding = False
        held, self._held = self._held, []
        for waiter in held:
            waiter.notify_waiters()
