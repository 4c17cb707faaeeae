"""ReleasePeriod: how long the session's sender sleeps between its release ticks.

A dropped lease waits for a plan message of its stream to carry it
(``loaderd.shm.leases``); what no plan took within a whole period the sender
sends. In a fast loop plans carry nearly everything, and a sender that woke
every 5 ms all the same cost a fifth of every wake-up per batch
(tests/bench/profile_path.py, float32 batches over shared memory). So:

- a tick that found nothing to send doubles the period, up to ``backoff``
  times the shortest (plans flow: look less often);
- a tick that sent something brings it back to the shortest;
- so does an epoch's final stretch (``hurry``: its plan is out but for what the
  caller's last steps ask, so nothing it drops rides a plan from now on), and
  the period stays the shortest until a tick finds nothing pending at all (the
  first ticks after it find nothing due yet: those leases are still young).

Measured (f32 over shared memory, Intel Xeon, 2 cores): an epoch's last leases,
sent by the session, waited 8.2 ms (median) with a fixed 5 ms period; with the
backoff and the hurry at the epoch's ``end`` message (sent once every batch
arrived) they waited 15-17 ms and the pool kept 3-4 more 12.6 MB segments;
hurried at the final stretch, 8.3 ms.

A lease no plan takes waits at most two of the longest periods, once, and then
one to two of the shortest.
"""

from __future__ import annotations


class ReleasePeriod:
    """The sender's current period, in seconds (one sender thread uses it: no lock).

    The shortest period is passed at every call rather than kept: a test may lengthen the
    product's on a session that is already open (``loaderd.shm.session.RELEASE_PERIOD_S``).
    """

    def __init__(self, shortest_s: float, backoff: int) -> None:
        self.backoff = backoff
        self.seconds = shortest_s
        self.hurried = False  # since an epoch's final stretch began, until nothing is pending

    def ticked(self, sent: bool, pending: bool, shortest_s: float) -> float:
        """After a tick that ``sent`` leases (or none), leaving some ``pending`` (or none): the period until the next."""
        if sent:
            self.seconds = shortest_s
        elif not self.hurried:
            self.seconds = min(2 * self.seconds, self.backoff * shortest_s)
        if not pending:
            self.hurried = False
        return self.seconds

    def hurry(self, shortest_s: float) -> float:
        """A stream's epoch reached its final stretch: the shortest period, until nothing is pending."""
        self.seconds = shortest_s
        self.hurried = True
        return self.seconds
