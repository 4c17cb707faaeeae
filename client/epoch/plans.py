"""Plan: who plans an epoch's positions, and where the epoch ends.

- ``SamplerPlan`` (map-style): the caller's index sampler, walked in the caller's thread (so
  the client's RNG is consumed exactly as torch consumes it). Positions are planned until the
  daemons hold their lanes' windows beyond what the caller consumed, a quarter window at a
  time; the epoch ends where the sampler does, once every position is consumed. When every
  planned position is answered, the lanes' plans may end (the client says so).
- ``CreditPlan`` (an IterableDataset): the daemon runs the replicas and numbers the batches;
  the client tells its lane how far the caller got (its credit: the daemon runs at most a
  window past it), and the epoch ends at the position where the daemon ended the lane.

Either answers each position once: the first answer counts. Used from the iterator's thread only.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from loaderd.epoch.positions import Positions

# The plan tops up a quarter window at a time, not batch by batch: one message then
# carries several batches (~15% less CPU per tiny batch, measured A/B), and the
# daemons still hold at least three quarters of the window.
PLAN_STEP_DIVISOR = 4


class Plan(Protocol):
    """An epoch's plan, as its iterator asks it (the module docstring has the rules)."""

    def top_up(self, consumed: int, stalled_s: float) -> bool:
        """The caller consumed ``consumed`` positions (waiting ``stalled_s`` s in all): keep the daemons
        a window ahead. True if positions may now wait for lanes."""
        ...

    def answered(self, position: int) -> bool:
        """``position`` was answered; False if it had been already (the other answer to a hedge)."""
        ...

    def ended(self, at: int) -> None:
        """The daemon ended a lane's plan; its next answer would have been for position ``at``."""
        ...

    def over(self, consumed: int) -> bool:
        """Whether the caller consumed every position of the epoch."""
        ...

    @property
    def complete(self) -> bool:
        """Every position is planned and answered: the lanes' plans may end."""
        ...

    @property
    def all_out(self) -> bool:
        """Every position of a sized plan is planned (the loader may plan its next epoch ahead)."""
        ...

    @property
    def final_stretch(self) -> bool:
        """No plan message follows before the caller reaches the epoch's end (all is planned, but for a
        last batch planned only when asked for): the lanes' dropped leases ride no plan from now on."""
        ...


class Credited(Protocol):
    """What a ``CreditPlan`` needs of its lane."""

    @property
    def window(self) -> int: ...  # how many batches the daemon may run past the credit

    def credit(self, consumed: int, stalled_us: int) -> None: ...


class SamplerPlan:
    """A map-style epoch's plan: index batches from the caller's sampler, into ``positions``."""

    def __init__(
        self,
        sampler_iter: Iterator[Any],
        start: int,
        positions: Positions[Any],
        capacity: Callable[[], int],
        *,
        plan_length: int | None,
        last_batch_draws: bool,
        auto_collation: bool,
    ) -> None:
        """``start``: the first position to plan (a resume's positions before it were consumed earlier);
        ``capacity``: how many positions past the caller the lanes may hold now; ``plan_length``: the
        sampler's batches, where it has a length; ``last_batch_draws``: making its last batch draws from
        a generator (``loaderd.epoch.index_batches.last_batch_draws``)."""
        self._sampler_iter = sampler_iter
        self._positions = positions
        self._capacity = capacity
        self._plan_length = plan_length
        self._last_batch_draws = last_batch_draws
        self._auto_collation = auto_collation
        self.planned = start
        self.done = False  # the sampler ended

    def top_up(self, consumed: int, stalled_s: float) -> bool:
        """Producing the last batch can exhaust the sampler, and an exhausted RandomSampler draws
        from its generator once more; torch (num_workers=0) only does that when the caller asks for
        the last batch. So such a last batch (``last_batch_draws``), and anything past the end, is
        planned only when asked for: an epoch stopped early leaves the user's generator where torch does.
        """
        if self.done:
            return False
        capacity = self._capacity()
        target = consumed + capacity
        plan_length = self._plan_length
        if plan_length is not None:
            if consumed >= plan_length:  # asked past the end: the sampler ends (and draws) now
                target = consumed + 1
            elif self._last_batch_draws:
                last = plan_length - 1
                target = min(target, last if consumed < last else plan_length)
            else:
                target = min(target, plan_length)
        clamped = target != consumed + capacity  # the epoch's end: plan it as it comes
        if not clamped and target - self.planned < max(1, capacity // PLAN_STEP_DIVISOR):
            target = self.planned  # less than a step has room: wait for a whole one
        auto_collation = self._auto_collation
        while self.planned < target:
            try:
                item = next(self._sampler_iter)
            except StopIteration:
                self.done = True
                break
            self._positions.plan(self.planned, _as_indices(item, auto_collation))
            self.planned += 1
        return True

    def answered(self, position: int) -> bool:
        return self._positions.answered(position)

    def ended(self, at: int) -> None:
        pass  # the client ended the lane's plan (``complete``): the sampler says where the epoch ends

    def over(self, consumed: int) -> bool:
        return self.done and consumed >= self.planned

    @property
    def complete(self) -> bool:
        return self.done and not self._positions.outstanding

    @property
    def all_out(self) -> bool:
        return self._plan_length is not None and self.planned >= self._plan_length

    @property
    def final_stretch(self) -> bool:
        if self.done:
            return True
        held_back = 1 if self._last_batch_draws else 0  # top_up plans that one when the caller asks for it
        return self._plan_length is not None and self.planned >= self._plan_length - held_back


class CreditPlan:
    """An IterableDataset's plan: the daemon's, paced by the credit the client grants its lane."""

    def __init__(self, lanes: Mapping[str, Credited], start: int) -> None:
        """``lanes``: the epoch's open lanes (one at most); ``start``: the position the caller is at."""
        self._lanes = lanes
        self._credited = start  # the consumed count last reported to the daemon
        self._end_at: int | None = None  # the epoch ends at this position

    def top_up(self, consumed: int, stalled_s: float) -> bool:
        # The credit: the daemon runs at most `window` batches past what was reported.
        # Reported every quarter window, not every batch (one message fewer per batch).
        lane = next(iter(self._lanes.values()), None)
        if lane is not None and consumed - self._credited >= max(1, lane.window // 4):
            self._credited = consumed
            lane.credit(consumed, int(stalled_s * 1e6))
        return False

    def answered(self, position: int) -> bool:
        return True  # one lane, counting on from where it opened: each position is answered once

    def ended(self, at: int) -> None:
        self._end_at = at

    def over(self, consumed: int) -> bool:
        return self._end_at is not None and consumed >= self._end_at

    @property
    def complete(self) -> bool:
        return False  # the daemon ends the lane's plan, not the client

    @property
    def all_out(self) -> bool:
        return False  # no length: the daemon's replicas say where the epoch ends

    @property
    def final_stretch(self) -> bool:
        return False  # credit messages carry no leases: the session sends them all


def _as_indices(item: Any, auto_collation: bool) -> list[int]:
    try:
        if auto_collation:
            return [operator.index(i) for i in item]
        return [operator.index(item)]
    except TypeError:
        raise TypeError(f"loaderd sends integer indices to the daemon; the sampler produced {item!r}") from None
