"""ReleasePeriod: the session sender's period backs off while plans carry the releases, and comes back."""

from __future__ import annotations

import pytest

from loaderd.shm.release_period import ReleasePeriod

pytestmark = pytest.mark.timeout(10)


def test_ticks_that_send_nothing_double_the_period_up_to_the_backoff() -> None:
    period = ReleasePeriod(0.005, backoff=16)
    assert period.seconds == 0.005
    waits = [period.ticked(False, True, 0.005) for _ in range(6)]
    assert waits == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.08, 0.08])


def test_a_tick_that_sends_or_a_streams_last_plan_brings_back_the_shortest() -> None:
    period = ReleasePeriod(0.005, backoff=16)
    for _ in range(5):
        period.ticked(False, True, 0.005)
    assert period.ticked(True, True, 0.005) == 0.005
    for _ in range(5):
        period.ticked(False, True, 0.005)
    assert period.hurry(0.005) == 0.005 and period.seconds == 0.005


def test_the_shortest_period_is_read_at_every_tick() -> None:
    """A test that lengthens the product's period on an open session gets it from the next tick on."""
    period = ReleasePeriod(0.005, backoff=16)
    assert period.ticked(True, True, 0.05) == 0.05
    assert period.ticked(False, True, 0.05) == 0.1
    assert [period.ticked(False, True, 0.05) for _ in range(4)] == pytest.approx([0.2, 0.4, 0.8, 0.8])


def test_after_a_streams_last_plan_the_period_stays_short_until_nothing_is_pending() -> None:
    """The ticks right after an epoch's last plan find nothing due (its last leases are young yet): they must
    not double the period, or those leases wait two long periods for no plan."""
    period = ReleasePeriod(0.005, backoff=16)
    for _ in range(5):
        period.ticked(False, True, 0.005)
    period.hurry(0.005)
    assert [period.ticked(False, True, 0.005) for _ in range(3)] == [0.005] * 3
    assert period.ticked(True, True, 0.005) == 0.005
    assert period.ticked(False, False, 0.005) == 0.005  # nothing pending: the hurry is over
    assert period.ticked(False, True, 0.005) == 0.01  # plans carry again: back off
