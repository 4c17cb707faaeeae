"""HeldWakeups: a servicer waiting for its stream's next batch is woken when the scheduler next waits for the pool.

The scheduler's thread handles a round's results under its lock, one by one, then dispatches and waits for the pool.
A servicer woken as soon as its batch is resolved wakes into a thread that still holds the lock and the GIL: it
blocks on them at once and is woken a second time when they come free (bench profile_path.py: the daemon's
``loaderd-rpc`` threads woke 2.06 times a batch, f32 over shared memory, 2 workers). Held until the scheduler is
about to wait, the wake-up finds both free: 1.53 times a batch.

The rules (every method under the scheduler's lock, which the streams' conditions share):

* ``hold`` once the scheduler's thread has what the pool sent: wake-ups asked from then on, by any thread, are held;
* ``wake_held`` when its next dispatch is done, just before it waits for the pool again (in a ``finally``: after a
  dispatch that failed too), and when its thread ends: the held ones are woken, and later ones at once until the
  next ``hold``;
* so a wake-up asked while the scheduler waits for the pool goes at once, and a held one waits for the rest of the
  round (a replacement worker's fork included, after a death), plus 50 ms after a round that failed. Nothing waits
  longer than the servicer's own poll (``_POLL_S`` in server/rpc/servicer.py, 0.25 s): it looks for its batch then
  whether woken or not.
"""

from __future__ import annotations

from typing import Protocol


class Waiter(Protocol):
    """A stream as its servicer waits on it."""

    def notify_waiters(self) -> None: ...


class HeldWakeups:
    """The wake-ups held from ``hold`` until the scheduler next waits for the pool."""

    def __init__(self) -> None:
        self._held: list[Waiter] = []
        self._holding = False

    def hold(self) -> None:
        """The scheduler has what the pool sent: hold wake-ups from now."""
        self._holding = True

    def wake(self, waiter: Waiter) -> None:
        """Wake ``waiter``'s servicer: once the scheduler next waits for the pool, or now if it waits already."""
        if self._holding:
            self._held.append(waiter)
        else:
            waiter.notify_waiters()

    def wake_held(self) -> None:
        """The scheduler is about to wait for the pool (or its thread ends): wake what was held, and at once until the
        next ``hold``."""
        self._holding = False
        held, self._held = self._held, []
        for waiter in held:
            waiter.notify_waiters()
