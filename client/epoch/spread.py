"""SpreadPlacement: a map-style epoch over every usable daemon, by room, with hedges.

Every usable daemon gets a positioned lane. A daemon that drains or left DNS gives its work
to the others once a lane to one of them is open (with none, it keeps its work). Each waiting
position goes to the lane with the most room for its window, none beyond it
(``Positions.place_by_room``): a daemon that answers faster frees its window sooner and gets
more. A lane with room, to a usable daemon whose pace is known (``loaderd.stream.pace``), is
asked for positions another lane is late with (``Positions.hedges``: a hedge, the first answer
counts), so a slow daemon delays the epoch by about twice what a fast one would, not by its
window. The clock placement reads (``clock``) must be the lanes' own (``time.monotonic``, as
``Lane.owing_since``). With several lanes open, the caller's wait looks for late positions
every ``HEDGE_POLL_S``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Generic

from loaderd.epoch.placement import NOTHING, L, LaneSet
from loaderd.epoch.positions import Positions
from loaderd.fleet.fleet import Usable
from loaderd.stream.stream_call import POLL_S

HEDGE_POLL_S = 0.02


class SpreadPlacement(Generic[L]):
    """The ``Placement`` of a map-style epoch that is not a share."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # when positions are asked, and how late they are

    def reconcile(self, usable: Sequence[Usable], lanes: LaneSet[L], start: int) -> None:
        for member in usable:
            if member.address not in lanes.by_address:
                lanes.open(member)
        live = lanes.usable
        if any(address in live for address in lanes.by_address):
            for lane in [lane for address, lane in lanes.by_address.items() if address not in live]:
                lanes.drop(lane)

    def place(self, positions: Positions[L], lanes: Sequence[L]) -> Mapping[L, list[int]]:
        return positions.place_by_room(lanes, self._clock())

    def hedges(self, positions: Positions[L], lanes: LaneSet[L]) -> Mapping[L, list[int]]:
        # Only once nothing waits: waiting work goes to lanes with room first.
        if len(lanes.by_address) < 2 or positions.waiting:
            return NOTHING
        live = lanes.usable
        idle = [
            lane
            for address, lane in lanes.by_address.items()
            if address in live and lane.answered and lane.outstanding < lane.window
        ]
        if not idle:
            return NOTHING
        return positions.hedges(list(lanes.by_address.values()), idle, self._clock())

    def poll_s(self, lanes: LaneSet[L]) -> float:
        return HEDGE_POLL_S if len(lanes.by_address) > 1 else POLL_S
