"""SharePlacement: a shared job's epoch, on one lane at the daemon every consumer picks.

Rendezvous hashing of the share's name over the usable daemons (``loaderd.wire.rendezvous``)
gives every consumer of the share the same first choice, so they meet on one daemon's job.
When the pick changes (a daemon came back, or the chosen one drains or is lost) the lane
moves: it is dropped, and the first choice that opens gets a contiguous lane from the first
position not received. With no daemon usable the lane stays where it is. The one lane is
asked every waiting position, in order (the plan runs no more than its window ahead); nothing
is hedged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Generic

from loaderd.epoch.placement import NOTHING, L, LaneSet, open_first
from loaderd.epoch.positions import Positions
from loaderd.fleet.fleet import Usable
from loaderd.stream.stream_call import POLL_S
from loaderd.wire.rendezvous import rendezvous_order


class SharePlacement(Generic[L]):
    """The ``Placement`` of a share's epoch (``share=``)."""

    def __init__(self, name: str) -> None:
        self._name = name  # the share's: what every consumer hashes alike

    def reconcile(self, usable: Sequence[Usable], lanes: LaneSet[L], start: int) -> None:
        current = next(iter(lanes.by_address.values()), None)
        order = rendezvous_order(self._name, sorted(lanes.usable))
        if current is not None and order and current.address != order[0]:
            lanes.drop(current)  # with no daemon usable it stays: it may yet answer
        open_first(order, usable, lanes, start)

    def place(self, positions: Positions[L], lanes: Sequence[L]) -> Mapping[L, list[int]]:
        lane = lanes[0]
        return {lane: positions.place_in_order(lane)}

    def hedges(self, positions: Positions[L], lanes: LaneSet[L]) -> Mapping[L, list[int]]:
        return NOTHING

    def poll_s(self, lanes: LaneSet[L]) -> float:
        return POLL_S
