"""Placement: where one epoch streams from, and which lane is asked for which position.

An epoch runs in one of three modes, each a placement the iterator is handed when it
begins (``loaderd.epoch.modes`` picks it from the ``EpochStream``); the iterator asks
its placement and never which mode it runs in:

- ``SpreadPlacement`` (``loaderd.epoch.spread``): a map-style epoch over every usable daemon.
- ``SharePlacement`` (``loaderd.epoch.share``): one lane, on the daemon every consumer of the share picks.
- ``IterablePlacement`` (``loaderd.epoch.iterable``): an IterableDataset's one lane, planned by the daemon.

The contract every placement keeps:

- ``reconcile`` opens and drops lanes through the ``LaneSet`` it is handed, to match the
  daemons usable now. A lane that cannot open is not there (``LaneSet.open`` returns None).
  Positioned lanes open with ``start=None``; a contiguous lane opens at the ``start`` it is
  given (the first position not received) and carries no positions.
- ``place`` and ``hedges`` only choose: the iterator sends each lane what they return.
  ``place`` is asked only while positions wait and some lane is open; what it leaves keeps
  waiting. ``hedges`` answers positions already held by another lane (the first answer counts).
- A placement keeps no lane beyond the call; it is used from the iterator's thread only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from loaderd.epoch.positions import Asked, Positions
from loaderd.fleet.fleet import Usable


class PlacedLane(Asked, Protocol):
    """What a placement reads of a lane, beyond what placing positions reads (``Asked``)."""

    @property
    def address(self) -> str: ...  # the daemon's

    @property
    def answered(self) -> int: ...  # batches it delivered (0: its daemon has not answered yet)


L = TypeVar("L", bound=PlacedLane)


class LaneSet(Protocol[L]):
    """An epoch's open lanes, as a placement reads and changes them (``loaderd.epoch.lanes``)."""

    @property
    def by_address(self) -> Mapping[str, L]: ...  # the open lanes

    @property
    def usable(self) -> Set[str]: ...  # the daemons usable at the last reconcile

    def serving(self) -> list[L]:
        """The open lanes to usable daemons; all open lanes if none is (a draining one keeps its work)."""
        ...

    def open(self, member: Usable, start: int | None = None) -> L | None:
        """A lane to ``member``, positioned (``start`` None) or contiguous from ``start``; None if it cannot open now."""
        ...

    def drop(self, lane: L) -> None:
        """Close ``lane``; the positions only it held wait for a lane again."""
        ...


class Placement(Protocol[L]):
    """One mode's rules for an epoch's lanes (the module docstring has the contract)."""

    def reconcile(self, usable: Sequence[Usable], lanes: LaneSet[L], start: int) -> None:
        """Open and drop ``lanes`` to match ``usable`` (address order); contiguous lanes open at ``start``."""
        ...

    def place(self, positions: Positions[L], lanes: Sequence[L]) -> Mapping[L, list[int]]:
        """The waiting positions each of ``lanes`` (serving, at least one) is asked now."""
        ...

    def hedges(self, positions: Positions[L], lanes: LaneSet[L]) -> Mapping[L, list[int]]:
        """Positions another lane is late with, each asked of a lane with room too."""
        ...

    def poll_s(self, lanes: LaneSet[L]) -> float:
        """How long the caller's wait for an answer sleeps before looking again (for late positions)."""
        ...


# What a placement that places nothing returns: one shared, read-only empty mapping, not a new dict
# for every batch.
NOTHING: Mapping[Any, list[int]] = MappingProxyType({})


def open_first(order: Sequence[str], usable: Sequence[Usable], lanes: LaneSet[L], start: int) -> None:
    """A contiguous placement's one lane, where none is open: to the first daemon of ``order`` that opens."""
    members = {u.address: u for u in usable}
    for address in order:
        if lanes.by_address or lanes.open(members[address], start) is not None:
            break
