"""ReleasePeriod: the session sender's period backs off while plans carry the releases, and comes back."""

from __future__ import annotations

import pytest

from loaderd.shm.release_period import ReleasePeriod

pytestmark = pytest.mark.timeout(10)

SHORTEST = 0.005


def plans_carry(period: ReleasePeriod, ticks: int) -> list[float]:
    """``ticks`` ticks that each find leases pending from the tick before taken by plans (nothing due)."""
    return [period.ticked(False, True, SHORTEST) for _ in range(ticks)]


def test_while_plans_take_what_was_pending_the_period_doubles_up_to_the_backoff() -> None:
    period = ReleasePeriod(backoff=16)
    assert period.seconds(SHORTEST) == SHORTEST
    assert plans_carry(period, 1) == [SHORTEST], "the first tick after a wake: nothing could have been due"
    assert plans_carry(period, 6) == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.08, 0.08])


def test_a_tick_after_one_that_left_nothing_pending_does_not_back_off() -> None:
    """A slow loop: the sender sleeps between releases, and each wake's first tick finds nothing due yet."""
    period = ReleasePeriod(backoff=16)
    for _ in range(5):
        assert period.ticked(False, True, SHORTEST) == SHORTEST  # the first tick: the lease is young
        assert period.ticked(True, False, SHORTEST) == SHORTEST  # the second sends it; nothing left
    assert period.seconds(SHORTEST) == SHORTEST


def test_a_tick_that_sends_brings_back_the_shortest() -> None:
    period = ReleasePeriod(backoff=16)
    plans_carry(period, 6)
    assert period.ticked(True, True, SHORTEST) == SHORTEST
    assert plans_carry(period, 1) == [0.01]


def test_after_an_epochs_final_stretch_the_period_stays_short_until_nothing_is_pending() -> None:
    """The ticks right after the final stretch began find nothing due (its last leases are young yet): they must
    not double the period, or those leases wait two long periods for no plan."""
    period = ReleasePeriod(backoff=16)
    plans_carry(period, 6)
    assert period.hurry(SHORTEST) == SHORTEST
    assert plans_carry(period, 3) == [SHORTEST] * 3
    assert period.ticked(True, True, SHORTEST) == SHORTEST
    assert period.ticked(False, False, SHORTEST) == SHORTEST  # nothing pending: the hurry is over
    assert plans_carry(period, 2) == [SHORTEST, 0.01]  # plans carry again: back off


def test_the_period_follows_the_shortest_read_at_each_use() -> None:
    """A test that lengthens the product's period on an open session gets it at once, backed off from there."""
    period = ReleasePeriod(backoff=16)
    plans_carry(period, 3)
    assert period.seconds(SHORTEST) == pytest.approx(0.02)
    assert period.seconds(0.05) == pytest.approx(0.2)
    assert period.ticked(True, True, 0.05) == 0.05
    assert [period.ticked(False, True, 0.05) for _ in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 0.8])
