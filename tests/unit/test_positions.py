"""Positions: planned batches, the lanes asked for each, and the placement policies."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from loaderd.epoch.positions import HEDGE_MIN_S, Positions


@dataclass(eq=False)
class FakeLane:
    name: str
    window: int
    latency: float = 0.0
    sent: deque[int] = field(default_factory=deque)

    @property
    def outstanding(self) -> int:
        return len(self.sent)

    def ask(self, positions: list[int]) -> None:
        self.sent.extend(positions)


def planned(count: int) -> Positions[FakeLane]:
    positions: Positions[FakeLane] = Positions()
    for p in range(count):
        positions.plan(p, [10 * p, 10 * p + 1])
    return positions


def test_a_share_asks_its_one_lane_for_everything_in_order() -> None:
    positions, lane = planned(5), FakeLane("A", window=2)
    assert positions.place_in_order(lane) == [0, 1, 2, 3, 4], "a share's lane is not bound by the window here"
    assert not positions.waiting and positions.outstanding
    assert positions.requests([1, 3]) == [(1, [10, 11]), (3, [30, 31])]


def test_spreading_fills_the_lane_with_the_most_room_and_stops_at_the_windows() -> None:
    positions = planned(7)
    a, b = FakeLane("A", window=2), FakeLane("B", window=4)
    b.ask([99])  # one already outstanding
    groups = positions.place_by_room([a, b], now=0.0)
    assert {lane.name: asked for lane, asked in groups.items()} == {"A": [0, 2], "B": [1, 3, 4]}
    assert positions.waiting, "5 and 6 wait: every window is full"


def test_answers_leave_the_table_once_and_a_lost_lane_gives_back_what_only_it_held() -> None:
    positions = planned(3)
    a, b = FakeLane("A", window=3), FakeLane("B", window=3)
    a.ask(positions.place_by_room([a], now=0.0)[a])
    assert positions.answered(0) is True
    assert positions.answered(0) is False, "the other answer to a position counts no more"
    a.sent.popleft()
    assert positions.lane_lost(a) == 2 and positions.waiting
    assert positions.place_by_room([b], now=1.0) == {b: [1, 2]}


def test_a_late_position_is_hedged_once_by_an_idle_lane_and_the_first_answer_counts() -> None:
    positions = planned(2)
    slow, fast = FakeLane("slow", window=2), FakeLane("fast", window=2, latency=0.01)
    slow.ask(positions.place_by_room([slow], now=0.0)[slow])
    assert positions.hedges([fast], now=HEDGE_MIN_S / 2) == {}, "not late yet"
    assert positions.hedges([fast], now=1.0) == {fast: [0, 1]}
    assert positions.hedges([FakeLane("third", window=2)], now=2.0) == {}, "hedged once"
    assert positions.answered(1) is True and positions.answered(1) is False
    assert positions.lane_lost(slow) == 0, "position 0 is still held by the hedging lane"


def test_restarted_clocks_make_nothing_late() -> None:
    positions = planned(1)
    slow, fast = FakeLane("slow", window=1), FakeLane("fast", window=1)
    slow.ask(positions.place_by_room([slow], now=0.0)[slow])
    positions.restart_clocks(10.0)
    assert positions.hedges([fast], now=10.0 + HEDGE_MIN_S / 2) == {}
    positions.clear()
    assert not positions.outstanding and not positions.waiting
