"""WindowFit: how many batches a map-style stream may have computing or ready at once, from the pool's state.

A client sizes its window for the pool alone (its prefetch per worker times the pool's most
workers). The daemon narrows that, never widens it, in two cases:

- an elastic pool below its most workers: the stream works the pool's ``share`` of its window
  ahead, but at least ``least`` batches (one more than the pool's workers hold, so that a
  stream the pool cannot keep up with shows it waits, and the pool grows);
- ``streams`` map-style loaders on the pool at once (DDP ranks, several trainers, a train and a
  validation loader; counted by training process and dataset, so that a loader's next epoch,
  opened before this one ends, is not a second one): each works its part of that, at least
  ``SHARED_LEAST`` batches.
  Without it N trainers slower than the pool would hold N windows of batches in shared
  memory, N times what one needs to keep the pool busy.

Rules: the result is between 1 and the stream's own window; an iterable stream keeps its
window (its credit is its replicas' turn, server/scheduling/stream.py). Shared jobs' consumers
are not counted: their job has its own buffer (server/scheduling/share.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A stream on a shared pool still has this many batches computing or ready: torch's default
# prefetch_factor for one worker, so one trainer's next batch is on its way while it takes one.
SHARED_LEAST = 2


@dataclass(frozen=True)
class WindowFit:
    """The pool's state a stream's dispatch window follows (module docstring)."""

    share: float = 1.0  # an elastic pool's workers now over its most; 1.0 for a fixed pool
    least: int = 1  # the fewest batches a stream works ahead for the pool's sake
    streams: int = 1  # map-style loaders drawing on the pool (the scheduler counts them)

    def window(self, own: int) -> int:
        """The dispatch window of a stream whose client asked for ``own`` batches."""
        pool = max(self.least, math.ceil(own * self.share))
        if self.streams > 1:
            pool = max(SHARED_LEAST, math.ceil(pool / self.streams))
        return max(1, min(own, pool))
