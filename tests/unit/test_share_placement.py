"""SharePlacement: a share's one lane, at the daemon every consumer picks, against fake lanes."""

from __future__ import annotations

from support.fake_lanes import FakeLane, FakeLanes

from loaderd.epoch.positions import Positions
from loaderd.epoch.share import SharePlacement
from loaderd.stream.stream_call import POLL_S
from loaderd.wire.rendezvous import rendezvous_order

DAEMONS = ("A", "B", "C")
ORDER = rendezvous_order("job", DAEMONS)


def test_one_contiguous_lane_at_the_share_s_first_choice() -> None:
    lanes = FakeLanes()
    SharePlacement("job").reconcile(lanes.look(*DAEMONS), lanes, start=5)
    assert lanes.opened == [(ORDER[0], 5)], "contiguous, from the first position not received"
    other = FakeLanes()
    SharePlacement("job").reconcile(other.look(*reversed(DAEMONS)), other, start=0)
    assert list(other.by_address) == [ORDER[0]], "every consumer meets on the same daemon"


def test_the_next_choice_where_the_first_does_not_open() -> None:
    lanes = FakeLanes()
    lanes.refuse = {ORDER[0]}
    SharePlacement("job").reconcile(lanes.look(*DAEMONS), lanes, start=3)
    assert lanes.opened == [(ORDER[1], 3)]


def test_the_lane_moves_when_the_pick_changes_and_stays_with_no_daemon_usable() -> None:
    lanes = FakeLanes(ORDER[1])
    SharePlacement("job").reconcile(lanes.look(ORDER[1], ORDER[2]), lanes, start=0)
    assert lanes.opened == [] and lanes.dropped == [], "it is the pick among the usable ones"
    SharePlacement("job").reconcile(lanes.look(*DAEMONS), lanes, start=9)
    assert lanes.dropped == [ORDER[1]] and lanes.opened == [(ORDER[0], 9)], "the first choice is back: the lane moves"
    SharePlacement("job").reconcile(lanes.look(), lanes, start=9)
    assert lanes.dropped == [ORDER[1]] and list(lanes.by_address) == [ORDER[0]], "nothing usable: it stays"


def test_the_lane_is_asked_every_waiting_position_in_order_and_nothing_is_hedged() -> None:
    positions: Positions[FakeLane] = Positions()
    for p in range(5):
        positions.plan(p, [p])
    lane = FakeLane("A", window=2)
    share: SharePlacement[FakeLane] = SharePlacement("job")
    assert share.place(positions, [lane]) == {lane: [0, 1, 2, 3, 4]}, "not bound by the window here"
    lanes = FakeLanes()
    lanes.by_address, lanes.usable = {"A": lane, "B": FakeLane("B", answered=1)}, {"A", "B"}
    assert share.hedges(positions, lanes) == {} and share.poll_s(lanes) == POLL_S
