"""An epoch's lanes as the client's placements and plans see them: no calls, no daemons.

``FakeLanes`` satisfies ``loaderd.epoch.placement.LaneSet`` over ``FakeLane``s (which satisfy
``PlacedLane`` and the plans' ``Credited``); it records what a placement opened and dropped,
and a test decides which daemons are usable and which refuse to open.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from loaderd.fleet.fleet import Usable


@dataclass(eq=False)
class FakeLane:
    address: str
    window: int = 4
    pace: float = 0.0
    answered: int = 0
    owing_since: float | None = None  # set by a test; None: owes nothing, or not late for it
    start: int | None = None  # None: positioned; else where the contiguous lane opened
    sent: deque[int] = field(default_factory=deque)
    credits: list[tuple[int, int]] = field(default_factory=list)

    @property
    def outstanding(self) -> int:
        return len(self.sent)

    def ask(self, positions: Sequence[int]) -> None:
        self.sent.extend(positions)

    def credit(self, consumed: int, stalled_us: int) -> None:
        self.credits.append((consumed, stalled_us))


class FakeLanes:
    """Lanes that open at once, except to the addresses in ``refuse``."""

    def __init__(self, *open_to: str, window: int = 4) -> None:
        self.window = window
        self.by_address: dict[str, FakeLane] = {a: FakeLane(a, window) for a in open_to}
        self.usable: set[str] = set()
        self.refuse: set[str] = set()
        self.opened: list[tuple[str, int | None]] = []  # (address, start) of each lane opened
        self.dropped: list[str] = []

    def look(self, *addresses: str) -> list[Usable]:
        """``addresses`` are the usable daemons now (as EpochLanes.look notes them)."""
        self.usable = set(addresses)
        return [Usable(a, 1) for a in sorted(addresses)]

    def serving(self) -> list[FakeLane]:
        lanes = self.by_address
        return [lane for address, lane in lanes.items() if address in self.usable] or list(lanes.values())

    def open(self, member: Usable, start: int | None = None) -> FakeLane | None:
        if member.address in self.refuse:
            return None
        lane = self.by_address[member.address] = FakeLane(member.address, self.window, start=start)
        self.opened.append((member.address, start))
        return lane

    def drop(self, lane: FakeLane) -> None:
        del self.by_address[lane.address]
        self.dropped.append(lane.address)
