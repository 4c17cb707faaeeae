"""AnswerPace: how fast a lane's daemon answers, from when its answers come.

A lane's daemon answers the positions it was asked in order, one after another while it has work. The time an answer
took is the gap since the previous answer, or since the position was asked if that came later (the lane had nothing
out in between). A first answer's wait is not one: it holds the stream's opening.

Answers come in bursts (a pool's workers finish together; a worker's quick results go several to a message), so one
gap says little: the pace is the mean of every gap until there are ``GAPS``, then a moving mean over about that many
answers, and it is known (non-zero) only from ``GAPS`` gaps on. Hedging reads it (loaderd.epoch.positions).
"""

from __future__ import annotations

# Gaps measured before the pace counts, and about how many answers its moving mean spans from then on.
GAPS = 5


class AnswerPace:
    """One lane's answers' pace and the time of its last answer. Used from the epoch's iterator thread only."""

    def __init__(self) -> None:
        self.seconds = 0.0  # seconds an answer (0.0: not known yet)
        self.last_at: float | None = None  # when the last answer came (None: none yet)
        self._gaps = 0
        self._mean = 0.0

    def answered(self, at: float, asked_at: float) -> None:
        """An answer came ``at``, for a position asked at ``asked_at`` (both ``time.monotonic``)."""
        if self.last_at is not None:
            self._gaps += 1
            took = max(0.0, at - max(self.last_at, asked_at))
            self._mean += (took - self._mean) / min(self._gaps, GAPS)
            if self._gaps >= GAPS:
                self.seconds = self._mean
        self.last_at = at
