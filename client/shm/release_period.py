"""ReleasePeriod: how long the session's sender sleeps between its release ticks.

A dropped lease waits for a plan message of its stream to carry it
(``loaderd.shm.leases``); what no plan took within a whole period the sender
sends. In a fast loop plans carry nearly everything, and a sender that woke
every 5 ms all the same woke about 0.4 times a batch for nothing
(tests/bench/HISTORY.md, fifteenth session). So the period is a factor of the
shortest (``loaderd.shm.session.RELEASE_PERIOD_S``, read at each use):

- a tick that found nothing due although the tick before left leases pending
  (so plans took them all) doubles the factor, up to ``backoff``;
- a tick that sent something sets it back to 1, and so does an epoch's final
  stretch (``hurry``: its plan is out, so nothing it drops rides a plan from
  now on); after a hurry it stays 1 until a tick finds nothing pending at all;
- a tick after one that left nothing pending (the first after the sender woke,
  or one in a running loop after plans took everything) changes nothing:
  nothing could have been due, so it says nothing about plans.

Worst case: the period is the session's, shared by every stream of the process
on that daemon. A lease no plan takes waits up to two of the longest periods
(2 x 80 ms at the product's settings) when it is dropped while another stream's
plans carry theirs (a validation loader drawn now and then beside a training
loader), or when the caller pauses mid-epoch; otherwise one to two of the
current period. Slots held that long cost memory, never correctness: the daemon
works at most a window ahead, and a worker with no free slot makes another.
"""

from __future__ import annotations


class ReleasePeriod:
    """The sender's current period (one sender thread uses it: no lock)."""

    def __init__(self, backoff: int) -> None:
        self._backoff = backoff
        self._factor = 1
        self._pending = False  # the last tick left leases pending
        self._hurried = False  # since an epoch's final stretch began, until nothing is pending

    def seconds(self, shortest_s: float) -> float:
        """The period now, for the product's shortest one (a test may change that on an open session)."""
        return self._factor * shortest_s

    def ticked(self, sent: bool, pending: bool, shortest_s: float) -> float:
        """After a tick that ``sent`` leases (or none), leaving some ``pending`` (or none): the period until the next."""
        if sent:
            self._factor = 1
        elif self._pending and not self._hurried:
            self._factor = min(2 * self._factor, self._backoff)
        self._pending = pending
        if not pending:
            self._hurried = False
        return self.seconds(shortest_s)

    def hurry(self, shortest_s: float) -> float:
        """A stream's epoch reached its final stretch: the shortest period, until nothing is pending."""
        self._factor = 1
        self._hurried = True
        return self.seconds(shortest_s)
