"""Positions: planned batches, the lanes asked for each, and the placement policies."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from loaderd.epoch.positions import HEDGE_MIN_S, Positions


@dataclass(eq=False)
class FakeLane:
    """A lane as placement reads it: what it was asked and when, and when it last answered."""

    name: str
    window: int
    pace: float = 0.0
    last_at: float | None = None  # when it last answered (None: never)
    sent: deque[int] = field(default_factory=deque)
    asked: deque[float] = field(default_factory=deque)  # when each of ``sent`` was asked

    @property
    def outstanding(self) -> int:
        return len(self.sent)

    @property
    def owing_since(self) -> float | None:
        if not self.asked:
            return None
        return self.asked[0] if self.last_at is None else max(self.last_at, self.asked[0])

    def ask(self, positions: list[int], at: float = 0.0) -> None:
        self.sent.extend(positions)
        self.asked.extend([at] * len(positions))

    def answer(self, at: float) -> int:
        self.asked.popleft()
        self.last_at = at
        return self.sent.popleft()


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
    slow, fast = FakeLane("slow", window=2), FakeLane("fast", window=2, pace=0.01, last_at=0.0)
    slow.ask(positions.place_by_room([slow], now=0.0)[slow])
    assert positions.hedges([slow, fast], [fast], now=HEDGE_MIN_S / 2) == {}, "not late yet"
    assert positions.hedges([slow, fast], [fast], now=1.0) == {fast: [0, 1]}, "a stream that has not answered in 1 s"
    third = FakeLane("third", window=2, pace=0.01, last_at=2.0)
    assert positions.hedges([slow, fast, third], [third], now=2.0) == {}, "hedged once"
    assert positions.answered(1) is True and positions.answered(1) is False
    assert positions.lane_lost(slow) == 0, "position 0 is still held by the hedging lane"


def alike(name: str, pace: float, now: float, window: int = 32) -> FakeLane:
    """A lane that answers every ``pace`` seconds, its last answer just now."""
    return FakeLane(name, window=window, pace=pace, last_at=now)


def holding(queues: list[tuple[FakeLane, range]], asked_at: float) -> Positions[FakeLane]:
    """Each lane asked for the positions of its queue, in order, at ``asked_at``."""
    positions: Positions[FakeLane] = Positions()
    for lane, queue in queues:
        for position in queue:
            positions.plan(position, [position])
        lane.ask(positions.place_by_room([lane], now=asked_at).get(lane, []), at=asked_at)
        assert list(lane.sent) == list(queue)
    return positions


def test_lanes_alike_with_deep_queues_never_hedge() -> None:
    # Two daemons alike, 27 and 28 positions queued, asked long ago: each answers its own at the same pace, so none is
    # late, however old (the old rule hedged positions asked twice a lane's mean wait ago, a mean its first answers,
    # from the front of its queue, made short: 4 needless batches an epoch in a test at 32 a lane).
    now = 10.0
    a, b = alike("A", 0.008, now), alike("B", 0.008, now)
    positions = holding([(a, range(0, 54, 2)), (b, range(1, 57, 2))], asked_at=0.0)
    assert positions.hedges([a, b], [a, b], now) == {}


def test_a_slow_lane_loses_the_positions_a_quick_one_would_answer_sooner_lowest_first() -> None:
    now = 10.0
    slow = alike("slow", 0.060, now)  # 60 ms an answer: position 7 in 480 ms
    quick = alike("quick", 0.004, now, window=6)  # 4 ms an answer, 2 queued: a new one in 12 ms; room for 4
    positions = holding([(slow, range(0, 8)), (quick, range(8, 10))], asked_at=0.0)
    # Position 0 comes in 60 ms, against 12 (24 for the fourth taken): not HEDGE_MIN_S sooner. 1-4 are.
    assert positions.hedges([slow, quick], [quick], now) == {quick: [1, 2, 3, 4]}


def test_a_stalled_lane_is_late_from_its_head_and_a_quiet_one_is_not() -> None:
    for quiet, hedged in [(0.005, []), (1.0, [0, 1])]:
        stalled = alike("stalled", 0.008, now=10.0 - quiet)  # last answered ``quiet`` s ago
        idle = alike("idle", 0.008, now=10.0)
        positions = holding([(stalled, range(0, 2))], asked_at=0.0)
        got = positions.hedges([stalled, idle], [idle], now=10.0)
        assert got == ({idle: hedged} if hedged else {}), quiet


def test_a_lane_still_opening_is_late_only_once_its_opening_outlasts_the_idle_lanes_queue() -> None:
    opening = FakeLane("opening", window=16)
    idle = alike("idle", 0.008, now=0.0)
    positions = holding([(opening, range(16)), (idle, range(16, 28))], asked_at=0.0)  # idle: a new position in 104 ms
    idle.last_at = 0.06  # answering all along
    # At 60 ms, counted at the idle lane's pace behind the time it has been opening, its last position comes in
    # 52 + 128 ms: not twice the idle lane's 104.
    assert positions.hedges([opening, idle], [idle], 0.06) == {}
    # At 300 ms every position it holds is late: lowest first, until the idle lane's own queue, growing with each one it
    # takes, would answer the next no sooner (the first 12, then only some of the deepest).
    idle.last_at = 0.3
    got = positions.hedges([opening, idle], [idle], 0.3)[idle]
    assert got[:12] == list(range(12)) and len(got) < 16, got


def test_an_unpaced_or_full_lane_hedges_nothing() -> None:
    now = 10.0
    stalled = alike("stalled", 0.008, now=0.0)
    unpaced = FakeLane("unpaced", window=8, last_at=now)  # fewer gaps than a pace needs
    full = alike("full", 0.001, now)
    positions = holding([(stalled, range(0, 4)), (full, range(4, 36))], asked_at=0.0)  # full: 32 of 32
    assert positions.hedges([stalled, unpaced, full], [unpaced, full], now) == {}


def test_a_lane_that_never_answers_loses_every_position_even_once_hedges_answered_its_first() -> None:
    hung = FakeLane("hung", window=16)
    idle = alike("idle", 0.008, now=0.0, window=4)
    positions = holding([(hung, range(16))], asked_at=0.0)
    now = 0.0
    while positions.outstanding and now < 4.0:
        now += 0.01
        for lane, asked in positions.hedges([hung, idle], [idle], now).items():
            lane.ask(asked, at=now)
        if idle.sent and now - idle.asked[0] >= idle.pace:  # the idle daemon answers at its pace
            positions.answered(idle.answer(now))
    # The hung lane still holds its first positions (their answers never come): it has owed one since it was asked.
    assert not positions.outstanding, f"stranded on a hung lane: {sorted(positions.asked())}"
    assert now < 1.0, now


def test_a_thief_silent_past_its_pace_is_that_much_later() -> None:
    now = 10.0
    holder = alike("holder", 0.010, now)
    silent = alike("silent", 0.004, now - 1.0)  # quick, but it has owed an answer for 1 s
    positions = holding([(holder, range(0, 8)), (silent, range(8, 9))], asked_at=0.0)
    assert positions.hedges([holder, silent], [silent], now) == {}


def test_restarted_clocks_make_nothing_late() -> None:
    positions = planned(1)
    slow, fast = FakeLane("slow", window=1), FakeLane("fast", window=1)
    slow.ask(positions.place_by_room([slow], now=0.0)[slow])
    positions.restart_clocks(10.0)
    assert positions.hedges([slow, fast], [fast], now=10.0 + HEDGE_MIN_S / 2) == {}
    positions.clear()
    assert not positions.outstanding and not positions.waiting
