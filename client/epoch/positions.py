"""Positions: a map-style epoch's batches that are planned and not yet received, and where each goes.

A position is planned (its indices known), then waits for a lane (lowest first), is asked of
one lane, maybe of a second one too (a hedge: the first answer counts), and leaves the table
when it is answered. A lane that is dropped gives back the positions only it held.

The placement policies decide which lane is asked, per mode:

- ``place_in_order`` (a share): one lane takes every waiting position, in order.
- ``place_by_room`` (positions spread over daemons): each goes to the lane with the most room
  for its window, none beyond it.
- ``hedges``: a lane with room is asked for positions another lane is late with (asked longer
  ago than ``HEDGE_FACTOR`` times what the idle lane takes to answer, at least ``HEDGE_MIN_S``).
  A slow or loaded daemon then delays the epoch by about that, not by its whole window; daemons
  alike never hedge (nothing is late), so no work is done twice in the steady state.

Used from the epoch's iterator thread only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

# A position is late once asked longer ago than this many times the idle lane's answer time ...
HEDGE_FACTOR = 2.0
# ... and at least this long ago (a lane's first answers make its latency noisy).
HEDGE_MIN_S = 0.05


class Asked(Protocol):
    """What placement reads of a lane."""

    @property
    def outstanding(self) -> int: ...  # positions asked and not answered

    @property
    def window(self) -> int: ...  # how many it may be asked at once

    @property
    def latency(self) -> float: ...  # seconds from asking a position to its answer (moving average)

    @property
    def sent(self) -> Sequence[int]: ...  # the positions it was asked and has not answered


L = TypeVar("L", bound=Asked)


class Positions(Generic[L]):
    """The planned, unanswered positions of one map-style epoch, and the lanes asked for each."""

    def __init__(self) -> None:
        self._indices: dict[int, list[int]] = {}
        self._holders: dict[int, list[L]] = {}  # the lanes asked (none: waiting)
        self._waiting: list[int] = []  # a heap
        self._hedged: set[int] = set()
        self._asked_at: dict[int, float] = {}  # when a lane was first asked (spread only)

    @property
    def waiting(self) -> bool:
        """Some position waits for a lane."""
        return bool(self._waiting)

    @property
    def outstanding(self) -> bool:
        """Some planned position has not been answered."""
        return bool(self._holders)

    def __contains__(self, position: int) -> bool:
        """Whether ``position`` is planned and not yet answered."""
        return position in self._holders

    def asked(self) -> dict[int, tuple[L, ...]]:
        """Each unanswered position and the lanes asked for it (a copy; for diagnostics and benchmarks)."""
        return {position: tuple(lanes) for position, lanes in self._holders.items()}

    def plan(self, position: int, indices: list[int]) -> None:
        """A new position, waiting for a lane."""
        self._indices[position] = indices
        self._holders[position] = []
        heapq.heappush(self._waiting, position)

    def requests(self, positions: list[int]) -> list[tuple[int, list[int]]]:
        """(position, indices) for each, as a lane sends them."""
        return [(p, self._indices[p]) for p in positions]

    def answered(self, position: int) -> bool:
        """``position`` was answered: it leaves the table. False if it had left already (the other
        answer to a hedged position: the first one counts)."""
        if self._holders.pop(position, None) is None:
            return False
        self._indices.pop(position, None)
        self._asked_at.pop(position, None)
        self._hedged.discard(position)
        return True

    def lane_lost(self, lane: L) -> int:
        """``lane`` is gone: the positions it owed and no other lane holds wait again. Returns how many."""
        moved = 0
        for position in lane.sent:
            holders = self._holders.get(position)
            if holders is None:
                continue  # received from another lane already
            if lane in holders:
                holders.remove(lane)
                self._hedged.discard(position)  # whoever holds it now may be hedged again
            if not holders:
                heapq.heappush(self._waiting, position)
                moved += 1
        return moved

    def restart_clocks(self, now: float) -> None:
        """Count every position as asked ``now`` (an epoch planned ahead asked them before it was iterated)."""
        for position in self._asked_at:
            self._asked_at[position] = now

    def clear(self) -> None:
        self._indices.clear()
        self._holders.clear()
        self._waiting.clear()
        self._hedged.clear()
        self._asked_at.clear()

    # ------------------------------------------------------------ placement

    def place_in_order(self, lane: L) -> list[int]:
        """A share's policy: ``lane`` is asked every waiting position, lowest first."""
        positions = [heapq.heappop(self._waiting) for _ in range(len(self._waiting))]
        for position in positions:
            self._holders[position].append(lane)
        return positions

    def place_by_room(self, lanes: Sequence[L], now: float) -> dict[L, list[int]]:
        """The spread policy: each waiting position, lowest first, to the lane with the most room for
        its window; none beyond a lane's window (what does not fit waits)."""
        groups: dict[L, list[int]] = {}
        while self._waiting:
            best = min(lanes, key=lambda lane: (lane.outstanding + len(groups.get(lane, ()))) / lane.window)
            if best.outstanding + len(groups.get(best, ())) >= best.window:
                break
            position = heapq.heappop(self._waiting)
            groups.setdefault(best, []).append(position)
            self._holders[position].append(best)
            self._asked_at[position] = now
        return groups

    def hedges(self, idle: Sequence[L], now: float) -> dict[L, list[int]]:
        """The positions ``idle`` lanes (with room, answering) are asked too, because their lanes are late."""
        groups: dict[L, list[int]] = {}
        for position in sorted(self._holders):
            holders = self._holders[position]
            if not holders or position in self._hedged:
                continue
            room = [lane for lane in idle if lane.outstanding + len(groups.get(lane, ())) < lane.window]
            if not room:
                break
            candidates = [lane for lane in room if lane not in holders]
            if not candidates:
                continue
            thief = min(candidates, key=lambda lane: lane.latency)
            if now - self._asked_at[position] < max(HEDGE_MIN_S, HEDGE_FACTOR * thief.latency):
                continue
            self._hedged.add(position)
            holders.append(thief)
            groups.setdefault(thief, []).append(position)
        return groups
