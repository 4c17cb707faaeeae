"""IterablePlacement: an IterableDataset's one lane, planned by the daemon, against fake lanes."""

from __future__ import annotations

from support.fake_lanes import FakeLane, FakeLanes

from loaderd.epoch.iterable import IterablePlacement
from loaderd.epoch.positions import Positions
from loaderd.stream.lane import client_name
from loaderd.stream.stream_call import POLL_S
from loaderd.wire.rendezvous import rendezvous_order

DAEMONS = ("A", "B", "C")
LOADER = 1234
ORDER = rendezvous_order(f"{client_name()}/{LOADER}", DAEMONS)


def test_one_contiguous_lane_at_the_client_and_loader_s_pick() -> None:
    lanes = FakeLanes()
    lanes.refuse = {ORDER[0]}
    IterablePlacement(LOADER).reconcile(lanes.look(*DAEMONS), lanes, start=4)
    assert lanes.opened == [(ORDER[1], 4)], "the first choice that opens, from the first position not received"


def test_the_lane_stays_while_its_daemon_is_usable_and_moves_when_it_is_not() -> None:
    lanes = FakeLanes(ORDER[1])
    IterablePlacement(LOADER).reconcile(lanes.look(*DAEMONS), lanes, start=0)
    assert lanes.opened == [] and lanes.dropped == [], "moving would cost a replay: it stays"
    IterablePlacement(LOADER).reconcile(lanes.look(), lanes, start=0)
    assert lanes.dropped == [], "nothing usable: it stays"
    IterablePlacement(LOADER).reconcile(lanes.look(ORDER[0], ORDER[2]), lanes, start=6)
    assert lanes.dropped == [ORDER[1]] and lanes.opened == [(ORDER[0], 6)], "lost or draining: it reopens"


def test_nothing_is_placed_or_hedged_the_daemon_plans() -> None:
    positions: Positions[FakeLane] = Positions()
    lanes = FakeLanes("A")
    iterable: IterablePlacement[FakeLane] = IterablePlacement(LOADER)
    assert iterable.place(positions, [lanes.by_address["A"]]) == {}
    assert iterable.hedges(positions, lanes) == {} and iterable.poll_s(lanes) == POLL_S
