"""OutageClock: the time an epoch spends with no lane open, until a lane answers."""

from __future__ import annotations

from support.fakes import FakeClock

from loaderd.epoch.outage import OutageClock


def test_it_runs_only_while_no_lane_is_open_and_ends_when_one_answers() -> None:
    clock = FakeClock()
    outage = OutageClock(clock)
    assert not outage.active and outage.elapsed() == 0.0
    assert outage.no_lane() is True  # began: the caller warns once
    clock.now += 3
    assert outage.no_lane() is False  # still the same outage
    assert outage.elapsed() == 3.0
    outage.lane_opened()
    clock.now += 50  # a lane is open (a daemon replaying): not counted
    assert outage.elapsed() == 3.0 and outage.active
    assert outage.no_lane() is False  # the lane broke without answering: the same outage goes on
    clock.now += 2
    assert outage.elapsed() == 5.0
    outage.lane_opened()
    assert outage.answered() is True
    assert not outage.active and outage.elapsed() == 0.0
    assert outage.answered() is False  # nothing to end


def test_a_new_outage_starts_from_zero() -> None:
    clock = FakeClock()
    outage = OutageClock(clock)
    outage.no_lane()
    clock.now += 7
    outage.lane_opened()
    outage.answered()
    assert outage.no_lane() is True
    clock.now += 1
    assert outage.elapsed() == 1.0
