"""An epoch's mode: its placement and its plan, picked once from its ``EpochStream``.

The one place that tells the three modes apart; the iterator only asks what it is handed.

========  ===========================================  ================================
mode      placement (``loaderd.epoch.placement``)      plan (``loaderd.epoch.plans``)
========  ===========================================  ================================
spread    ``SpreadPlacement``: every usable daemon     ``SamplerPlan``: the caller's
share     ``SharePlacement``: the share's one daemon   sampler plans the positions
iterable  ``IterablePlacement``: one daemon            ``CreditPlan``: the daemon does
========  ===========================================  ================================
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from loaderd.epoch.epoch_stream import EpochStream
from loaderd.epoch.iterable import IterablePlacement
from loaderd.epoch.lanes import EpochLanes
from loaderd.epoch.placement import Placement
from loaderd.epoch.plans import CreditPlan, Plan, SamplerPlan
from loaderd.epoch.positions import Positions
from loaderd.epoch.share import SharePlacement
from loaderd.epoch.spread import SpreadPlacement
from loaderd.stream.lane import Lane


def epoch_mode(stream: EpochStream, lanes: EpochLanes, positions: Positions[Lane]) -> tuple[Placement[Lane], Plan]:
    """The placement and plan of ``stream``'s epoch, over its ``lanes`` and ``positions``."""
    start = stream.start
    if stream.iterable:
        return IterablePlacement(id(stream.calls)), CreditPlan(lanes.by_address, start.start)
    assert start.sampler_iter is not None  # map-style: begin_epoch made it
    plan = sampler_plan(stream, start.sampler_iter, start.start, lanes, positions)
    if stream.share is not None:
        return SharePlacement(stream.share.name), plan
    return SpreadPlacement(), plan


def sampler_plan(
    stream: EpochStream, sampler_iter: Iterator[Any], start: int, lanes: EpochLanes, positions: Positions[Lane]
) -> SamplerPlan:
    """A map-style epoch's plan from ``sampler_iter``, its first position ``start``."""
    return SamplerPlan(
        sampler_iter,
        start,
        positions,
        lanes.capacity,
        plan_length=stream.plan_length,
        last_batch_draws=stream.last_batch_draws,
        auto_collation=stream.auto_collation,
    )
