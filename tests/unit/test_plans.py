"""SamplerPlan and CreditPlan: who plans an epoch's positions, and where it ends (no lanes, no daemons)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from support.fake_lanes import FakeLane

from loaderd.epoch.plans import CreditPlan, SamplerPlan
from loaderd.epoch.positions import Positions


class Sampler:
    """Index batches [0], [1], ... up to ``length``, counting how often it was asked (a draw each)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.asked = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> list[int]:
        self.asked += 1
        if self.asked > self.length:
            raise StopIteration
        return [self.asked - 1]


def sampler_plan(
    sampler: Iterator[Any], capacity: int = 8, start: int = 0, *, plan_length: int | None = None, last_batch_draws: bool = False
) -> tuple[SamplerPlan, Positions[FakeLane]]:
    positions: Positions[FakeLane] = Positions()
    plan = SamplerPlan(
        sampler, start, positions, lambda: capacity, plan_length=plan_length, last_batch_draws=last_batch_draws, auto_collation=True
    )
    return plan, positions


def test_the_sampler_plans_a_window_ahead_a_quarter_window_at_a_time() -> None:
    plan, positions = sampler_plan(Sampler(100), capacity=8)
    assert plan.top_up(0, 0.0) is True and plan.planned == 8 and positions.waiting
    assert positions.requests([0, 7]) == [(0, [0]), (7, [7])]
    plan.top_up(1, 0.0)
    assert plan.planned == 8, "one batch of room is less than a step (8 // 4)"
    plan.top_up(2, 0.0)
    assert plan.planned == 10


def test_a_resumed_plan_starts_at_its_first_position() -> None:
    plan, positions = sampler_plan(Sampler(100), capacity=4, start=20)
    plan.top_up(20, 0.0)
    assert plan.planned == 24 and 20 in positions and 19 not in positions


def test_a_last_batch_that_draws_is_planned_only_when_asked_for() -> None:
    sampler = Sampler(5)
    plan, _ = sampler_plan(sampler, capacity=8, plan_length=5, last_batch_draws=True)
    plan.top_up(0, 0.0)
    assert plan.planned == 4 and sampler.asked == 4, "the last batch waits for the caller"
    plan.top_up(4, 0.0)
    assert plan.planned == 5 and sampler.asked == 5 and not plan.done
    assert plan.all_out, "the whole sized plan is out"
    plan.top_up(5, 0.0)
    assert plan.done and sampler.asked == 6, "asked past the end: the sampler ends (and draws) now"
    assert plan.top_up(5, 0.0) is False, "nothing more to plan"


def test_without_a_drawing_last_batch_the_plan_runs_to_its_length() -> None:
    sampler = Sampler(5)
    plan, _ = sampler_plan(sampler, capacity=8, plan_length=5)
    plan.top_up(0, 0.0)
    assert plan.planned == 5 and sampler.asked == 5 and not plan.done


def test_the_epoch_ends_where_the_sampler_does_once_everything_is_consumed() -> None:
    plan, positions = sampler_plan(Sampler(3), capacity=8)
    plan.top_up(0, 0.0)
    assert plan.done and plan.planned == 3
    assert not plan.complete, "planned, not answered"
    assert plan.answered(0) is True and plan.answered(0) is False, "the first answer counts"
    plan.answered(1), plan.answered(2)
    assert plan.complete and not positions.outstanding
    assert not plan.over(2) and plan.over(3)
    plan.ended(99)  # a lane's end says nothing of the epoch's
    assert not plan.over(2)


def test_indices_must_be_integers() -> None:
    plan, _ = sampler_plan(iter([["a"]]))
    with pytest.raises(TypeError, match="integer indices"):
        plan.top_up(0, 0.0)
    positions: Positions[FakeLane] = Positions()
    single = SamplerPlan(iter([3, 4]), 0, positions, lambda: 4, plan_length=None, last_batch_draws=False, auto_collation=False)
    single.top_up(0, 0.0)
    assert positions.requests([0, 1]) == [(0, [3]), (1, [4])], "without auto-collation each index is a batch"


def test_credit_is_granted_every_quarter_window_with_the_caller_s_wait() -> None:
    lane = FakeLane("A", window=8)
    plan = CreditPlan({"A": lane}, start=10)
    assert plan.top_up(11, 0.5) is False and lane.credits == []
    plan.top_up(12, 0.5)
    plan.top_up(13, 0.75)
    plan.top_up(14, 0.75)
    assert lane.credits == [(12, 500_000), (14, 750_000)], "from where the caller resumed, 8 // 4 at a time"
    assert CreditPlan({}, start=0).top_up(5, 0.0) is False, "no lane open: nothing to credit"


def test_an_iterable_epoch_ends_where_the_daemon_ended_its_lane() -> None:
    plan = CreditPlan({}, start=0)
    assert plan.answered(3) is True and plan.answered(3) is True, "one contiguous lane: every answer counts"
    assert not plan.over(100) and not plan.complete and not plan.all_out
    plan.ended(7)
    assert not plan.over(6) and plan.over(7)
    assert not plan.complete, "the daemon ends the lane's plan, not the client"


def test_the_final_stretch_starts_once_nothing_is_planned_before_the_caller_reaches_the_end() -> None:
    """From then on no plan message carries the lanes' dropped leases: the session is told to send them soon."""
    held, _ = sampler_plan(Sampler(12), capacity=8, plan_length=12, last_batch_draws=True)
    held.top_up(0, 0.0)
    assert held.planned == 8 and not held.final_stretch
    held.top_up(4, 0.0)
    assert held.planned == 11 and held.final_stretch, "all but the last batch, which waits to be asked for"
    plain, _ = sampler_plan(Sampler(12), capacity=8, plan_length=12)
    plain.top_up(3, 0.0)
    assert plain.planned == 11 and not plain.final_stretch
    plain.top_up(5, 0.0)
    assert plain.planned == 12 and plain.final_stretch
    unsized, _ = sampler_plan(Sampler(3), capacity=8)
    unsized.top_up(0, 0.0)
    assert unsized.done and unsized.final_stretch
    assert CreditPlan({}, 0).final_stretch is False
