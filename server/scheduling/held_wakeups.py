"""HeldWakeups: a servicer waiting for its stream's next batch is woken when the scheduler next waits for the pool.

The scheduler's thread handles a round's results under its lock, one by one, then dispatches and waits for the pool.
A servicer woken as soon as its batch is resolved wakes into a thread that still holds the lock and the GIL: it
blocks on them at once and is woken a second time when they come free (bench profile_path.py: the daemon's
``loaderd-rpc`` threads woke 2.06 times a batch, f32 over shared memory, 2 workers). Held until the scheduler is
about to wait, the wake-up finds both free: 1.53 times a batch.

The rules (``wake`` and ``wake_held`` under the scheduler's lock, which the streams' conditions share):

* ``hold`` once the scheduler's thread has what the pool sent: wake-ups asked from then on, by any thread, are held.
  It takes no lock (one acquisition fewer a round): a ``wake`` that misses it wakes at once, which is always safe,
  and one that sees it appends what the scheduler's own next ``wake_held``, later on the same thread, wakes;
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


class Waited(Protocol):
    """What a servicer waits on: its stream's condition (``threading.Condition``)."""

    def notify_all(self) -> None: ...


class HeldWakeups:
    """The wake-ups held from ``hold`` until the scheduler next waits for the pool."""

    def __init__(self) -> None:
        self._held: list[Waited] = []
        self._holding = False

    def hold(self) -> None:
        """The scheduler has what the pool sent: hold wake-ups from now."""
        self._holding = True

    def wake(self, waited: Waited) -> None:
        """Wake the servicer waiting on ``waited``: once the scheduler next waits for the pool, or now if it waits already."""
        if self._holding:
            self._held.append(waited)
        else:
            waited.notify_all()

    def wake_held(self) -> None:
        """The scheduler is about to wait for the pool (or its thread ends): wake what was held, and at once until the
        next ``hold``."""
        self._holding = False
        if not self._held:
            return  # most rounds: nothing to wake, nothing to allocate
        held, self._held = self._held, []
        for waited in held:
            waited.notify_all()
