"""IterablePlacement: an IterableDataset's epoch, on one lane the daemon plans.

The daemon runs the dataset's replicas and numbers their batches itself: the lane is
contiguous, and the client places no positions (it grants credit: ``loaderd.epoch.plans``).
The lane goes to the daemon that rendezvous hashing of the client and its loader picks over
the usable set (by loader, not epoch: the loader's next epoch finds its call to the same
daemon), and stays there while that daemon is usable, even when the pick changes (moving
costs a replay). Lost or draining, it reopens at the first choice that opens, from the first
position not received (the daemon produces the replicas again up to there and drops that
part, as a resume does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Generic

from loaderd.epoch.placement import NOTHING, L, LaneSet, open_first
from loaderd.epoch.positions import Positions
from loaderd.fleet.fleet import Usable
from loaderd.stream.lane import client_name
from loaderd.stream.stream_call import POLL_S
from loaderd.wire.rendezvous import rendezvous_order


class IterablePlacement(Generic[L]):
    """The ``Placement`` of an IterableDataset's epoch."""

    def __init__(self, loader: int) -> None:
        self._loader = loader  # which of the client's loaders this is (the id of its calls)

    def reconcile(self, usable: Sequence[Usable], lanes: LaneSet[L], start: int) -> None:
        current = next(iter(lanes.by_address.values()), None)
        # The client's name is read now: a forked child is another client.
        order = rendezvous_order(f"{client_name()}/{self._loader}", sorted(lanes.usable))
        if current is not None and order and current.address not in lanes.usable:
            lanes.drop(current)  # with no daemon usable it stays: it may yet answer
        open_first(order, usable, lanes, start)

    def place(self, positions: Positions[L], lanes: Sequence[L]) -> Mapping[L, list[int]]:
        return NOTHING  # nothing waits: the daemon plans an iterable's batches

    def hedges(self, positions: Positions[L], lanes: LaneSet[L]) -> Mapping[L, list[int]]:
        return NOTHING

    def poll_s(self, lanes: LaneSet[L]) -> float:
        return POLL_S
