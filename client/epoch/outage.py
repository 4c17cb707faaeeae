"""OutageClock: how long an epoch has gone without a daemon to stream from.

An outage runs from the moment an epoch has no lane open until some lane answers. Its clock
runs only while no lane is open (a daemon working through a long replay is not an outage),
and a lane that opens and breaks without answering does not end it: ``failover_timeout``
bounds the time spent with nothing open, however often daemons come and go meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class OutageClock:
    """One epoch's outage. Used from the epoch's iterator thread only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.active = False  # an outage began and no lane has answered since
        self._since: float | None = None  # the current stretch without an open lane
        self._before = 0.0  # earlier stretches of this outage

    def no_lane(self) -> bool:
        """The epoch has no lane open: the clock runs. True if this began an outage."""
        if self._since is None:
            self._since = self._clock()
        began = not self.active
        self.active = True
        return began

    def lane_opened(self) -> None:
        """A lane opened: the clock stops (the outage goes on until the lane answers)."""
        if self._since is not None:
            self._before += self._clock() - self._since
            self._since = None

    def answered(self) -> bool:
        """A lane answered: the outage, if any, is over. True if one was."""
        ended = self.active
        self.active, self._since, self._before = False, None, 0.0
        return ended

    def elapsed(self) -> float:
        """Seconds this outage has gone without an open lane."""
        running = self._clock() - self._since if self._since is not None else 0.0
        return self._before + running
