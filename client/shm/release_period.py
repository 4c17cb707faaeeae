"""ReleasePeriod: how long the session's sender sleeps between its release ticks.

A dropped lease waits for a plan message of its stream to carry it
(``loaderd.shm.leases``); what no plan took within a whole period the sender
sends. In a fast loop plans carry nearly everything, and a sender that woke
every 5 ms all the same cost a fifth of every wake-up per batch
(tests/bench/profile_path.py, float32 batches over shared memory). So:

- a tick that found nothing to send doubles the period, up to ``backoff``
  times the shortest (plans flow: look less often);
- a tick that sent something, or a stream's last plan (``hurry``: nothing of
  that stream rides a plan from now on), brings it back to the shortest.

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

    def ticked(self, sent: bool, shortest_s: float) -> float:
        """After a tick that ``sent`` leases (or none): the period until the next one."""
        self.seconds = shortest_s if sent else min(2 * self.seconds, self.backoff * shortest_s)
        return self.seconds

    def hurry(self, shortest_s: float) -> float:
        """A stream sent its last plan: back to the shortest period."""
        self.seconds = shortest_s
        return self.seconds
