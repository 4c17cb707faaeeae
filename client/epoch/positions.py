"""Positions: a map-style epoch's batches that are planned and not yet received, and where each goes.

A position is planned (its indices known), then waits for a lane (lowest first), is asked of
one lane, maybe of a second one too (a hedge: the first answer counts), and leaves the table
when it is answered. A lane that is dropped gives back the positions only it held.

The placement policies decide which lane is asked, per mode:

- ``place_in_order`` (a share): one lane takes every waiting position, in order.
- ``place_by_room`` (positions spread over daemons): each goes to the lane with the most room
  for its window, none beyond it.
- ``hedges``: a lane with room is asked for positions another lane is late with: a position is
  late when its lane would answer it more than ``HEDGE_FACTOR`` times, and ``HEDGE_MIN_S``
  seconds, later than the idle lane would (and it was asked ``HEDGE_MIN_S`` ago at least). Each
  lane answers in the order it was asked, so a position's wait on its lane is the positions
  ahead of it there, plus itself, at that lane's pace (seconds an answer,
  ``loaderd.stream.pace``), plus however long the lane is past its next answer: the time it has
  owed an answer (since its last one, or since it was asked the oldest position it holds, if
  later: a stalled or hung daemon, or one still opening its stream) less one pace. A lane not
  paced yet counts at the idle lane's pace. The idle lane's wait is its own queue, plus one, at
  its pace, plus its own lateness. A slow or stalled daemon then delays the epoch by about that,
  not by its whole window; daemons alike never hedge (their queues drain at one pace), so no
  work is done twice in the steady state, however deep the windows, as long as every answer
  that arrived is taken in first (the iterator's ``_hedge``). Until 2026-11-29 a position was
  late once asked twice the idle lane's mean wait ago: a lane's first answers, from the front of
  its queue, made that mean short, and every later epoch of a loader with deep windows hedged a
  few positions it did not need.

Used from the epoch's iterator thread only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

# A position is late once its lane would answer it this many times later than the idle lane would ...
HEDGE_FACTOR = 2.0
# ... and was asked at least this long ago (a lane's first answers make its pace noisy).
HEDGE_MIN_S = 0.05


class Asked(Protocol):
    """What placement reads of a lane."""

    @property
    def outstanding(self) -> int: ...  # positions asked and not answered

    @property
    def window(self) -> int: ...  # how many it may be asked at once

    @property
    def sent(self) -> Sequence[int]: ...  # the positions it was asked and has not answered, in the order it answers

    @property
    def pace(self) -> float: ...  # seconds between its answers while it had work (a mean; 0.0: not known yet)

    @property
    def owing_since(self) -> float | None:
        """Since when it owes an answer and gave none: its last answer, or the oldest position it holds if asked later;
        None if it holds nothing. On the clock ``hedges`` is given ``now`` by (``time.monotonic`` for a real lane)."""
        ...


L = TypeVar("L", bound=Asked)


class Positions(Generic[L]):
    """The planned, unanswered positions of one map-style epoch, and the lanes asked for each."""

    def __init__(self) -> None:
        self._indices: dict[int, list[int]] = {}
        self._holders: dict[int, list[L]] = {}  # the lanes asked (none: waiting)
        self._waiting: list[int] = []  # a heap
        self._hedged: set[int] = set()
        self._asked_at: dict[int, float] = {}  # when a lane was first asked (spread only)
        self._restarted_at = 0.0  # ``restart_clocks``: no lane owes anything from before then

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
        self._restarted_at = now

    def clear(self) -> None:
        self._restarted_at = 0.0
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

    def hedges(self, lanes: Sequence[L], idle: Sequence[L], now: float) -> dict[L, list[int]]:
        """The positions ``idle`` lanes (with room, answering) are asked too, because their lanes (among ``lanes``,
        the epoch's open ones) are late with them (the module docstring's rule), lowest first."""
        thieves = [lane for lane in idle if lane.pace > 0.0 and lane.outstanding < lane.window]
        if not thieves:
            return {}
        quickest = min(self._wait(lane, 0, now) for lane in thieves)
        late: list[tuple[int, L, float]] = []  # (position, its lane, the seconds until that lane answers it)
        for holder in lanes:
            if not holder.sent:
                continue
            # Not paced yet (loaderd.stream.pace): counted as quick as the quickest idle lane (an unpaced lane is
            # none of them).
            pace = holder.pace or min(lane.pace for lane in thieves)
            behind = self._behind(holder, pace, now)
            if not _late(behind + len(holder.sent) * pace, quickest):
                continue  # even its last position is not late: the steady state, nothing to scan
            for depth, position in enumerate(holder.sent):
                wait = behind + (depth + 1) * pace
                if not _late(wait, quickest) or position in self._hedged:
                    continue
                holders = self._holders.get(position)
                if holders is None or len(holders) != 1 or now - self._asked_at.get(position, now) < HEDGE_MIN_S:
                    continue  # answered (by a hedge), or held by another lane too, or asked just now
                late.append((position, holder, wait))
        groups: dict[L, list[int]] = {}
        for position, holder, wait in sorted(late, key=lambda item: item[0]):
            room = [lane for lane in thieves if lane is not holder and lane.outstanding + len(groups.get(lane, ())) < lane.window]
            if not room:
                continue
            thief_wait, thief = min(((self._wait(lane, len(groups.get(lane, ())), now), lane) for lane in room), key=lambda item: item[0])
            if not _late(wait, thief_wait):
                continue
            self._hedged.add(position)
            self._holders[position].append(thief)
            groups.setdefault(thief, []).append(position)
        return groups

    def _behind(self, lane: L, pace: float, now: float) -> float:
        """How far ``lane`` is past its next answer at ``pace``: the time it has owed one, less one pace (0.0 if it
        owes nothing). Nothing counts from before ``restart_clocks``."""
        since = lane.owing_since
        if since is None:
            return 0.0
        return max(0.0, now - max(since, self._restarted_at) - pace)

    def _wait(self, lane: L, extra: int, now: float) -> float:
        """Seconds until ``lane`` would answer a position asked now, behind what it holds and ``extra`` more (a lane
        silent past its next answer is that much later)."""
        return self._behind(lane, lane.pace, now) + (lane.outstanding + extra + 1) * lane.pace


def _late(wait: float, thief_wait: float) -> bool:
    """Whether a position its lane answers in ``wait`` seconds is late against a lane that would in ``thief_wait``."""
    return wait > HEDGE_FACTOR * thief_wait and wait - thief_wait >= HEDGE_MIN_S
