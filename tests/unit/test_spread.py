"""SpreadPlacement: a map-style epoch over every usable daemon, against fake lanes."""

from __future__ import annotations

from support.fake_lanes import FakeLane, FakeLanes
from support.fakes import FakeClock

from loaderd.epoch.positions import HEDGE_MIN_S, Positions
from loaderd.epoch.spread import HEDGE_POLL_S, SpreadPlacement
from loaderd.stream.stream_call import POLL_S


def planned(count: int) -> Positions[FakeLane]:
    positions: Positions[FakeLane] = Positions()
    for p in range(count):
        positions.plan(p, [p])
    return positions


def test_every_usable_daemon_gets_a_positioned_lane() -> None:
    lanes = FakeLanes("A")
    SpreadPlacement().reconcile(lanes.look("A", "B", "C"), lanes, start=7)
    assert lanes.opened == [("B", None), ("C", None)], "positioned lanes; A's stays open"
    assert list(lanes.by_address) == ["A", "B", "C"] and lanes.dropped == []


def test_a_daemon_that_left_gives_its_work_away_only_once_another_lane_is_open() -> None:
    lanes = FakeLanes("A", "B")
    SpreadPlacement().reconcile(lanes.look("B"), lanes, start=0)
    assert lanes.dropped == ["A"], "A drains (or left DNS): B takes its work"

    alone = FakeLanes("A")
    alone.refuse = {"B"}
    SpreadPlacement().reconcile(alone.look("B"), alone, start=0)
    assert alone.dropped == [] and list(alone.by_address) == ["A"], "B did not open: A keeps its work"
    SpreadPlacement().reconcile(alone.look(), alone, start=0)
    assert alone.dropped == [] and alone.opened == [], "no daemon usable: nothing moves"


def test_waiting_positions_go_to_the_lanes_with_most_room_none_beyond_its_window() -> None:
    positions = planned(7)
    a, b = FakeLane("A", window=2), FakeLane("B", window=4)
    b.ask([99])  # one already outstanding
    groups = SpreadPlacement().place(positions, [a, b])
    assert {lane.address: asked for lane, asked in groups.items()} == {"A": [0, 2], "B": [1, 3, 4]}
    assert positions.waiting, "5 and 6 wait: every window is full"


def test_an_idle_answering_lane_hedges_late_positions_of_another() -> None:
    clock = FakeClock(0.0)
    spread: SpreadPlacement[FakeLane] = SpreadPlacement(clock)
    positions = planned(2)
    lanes = FakeLanes()
    slow, fast = FakeLane("A", window=2), FakeLane("B", window=2, pace=0.01, answered=6)
    lanes.by_address, lanes.usable = {"A": slow, "B": fast}, {"A", "B"}
    slow.ask(spread.place(positions, [slow])[slow])  # asked at the clock's 0.0
    slow.owing_since = 0.0
    clock.now = HEDGE_MIN_S / 2
    assert spread.hedges(positions, lanes) == {}, "not late yet"
    clock.now = 1.0
    assert spread.hedges(positions, lanes) == {fast: [0, 1]}
    assert spread.hedges(positions, lanes) == {}, "hedged once"

    def unanswered(lane: FakeLane) -> None:
        lane.answered, lane.pace = 0, 0.0

    for why, change in [
        ("a lane that has not answered yet", lambda: unanswered(fast)),
        ("a lane to a daemon that is not usable", lambda: lanes.usable.discard("B")),
        ("a lane without room", lambda: fast.ask([7, 8])),
    ]:
        positions, fast = planned(2), FakeLane("B", window=2, pace=0.01, answered=6)
        slow = FakeLane("A", window=2)
        lanes.by_address, lanes.usable = {"A": slow, "B": fast}, {"A", "B"}
        clock.now = 0.0
        slow.ask(spread.place(positions, [slow])[slow])
        slow.owing_since = 0.0
        clock.now = 1.0
        change()
        assert spread.hedges(positions, lanes) == {}, f"{why} does not hedge"


def test_no_hedges_with_one_lane_or_while_positions_wait() -> None:
    clock = FakeClock(0.0)
    spread: SpreadPlacement[FakeLane] = SpreadPlacement(clock)
    positions = planned(3)
    slow, fast = FakeLane("A", window=2), FakeLane("B", window=2, answered=1)
    slow.ask(spread.place(positions, [slow])[slow])
    clock.now = 10.0
    lanes = FakeLanes()
    lanes.by_address, lanes.usable = {"A": slow}, {"A", "B"}
    assert spread.hedges(positions, lanes) == {}, "one lane: nobody to hedge with"
    lanes.by_address["B"] = fast
    assert positions.waiting
    assert spread.hedges(positions, lanes) == {}, "position 2 waits: waiting work goes first"


def test_several_lanes_look_for_late_positions_often() -> None:
    lanes = FakeLanes("A")
    assert SpreadPlacement().poll_s(lanes) == POLL_S
    lanes.by_address["B"] = FakeLane("B")
    assert SpreadPlacement().poll_s(lanes) == HEDGE_POLL_S
