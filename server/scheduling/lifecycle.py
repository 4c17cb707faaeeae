"""WorkerLifecycle: each pool slot's state, from start to death and replacement, with its rules.

A slot is in one state at a time (``SlotState``):

- SERVING: its worker runs and takes tasks.
- DRAINING: it did its share of tasks or grew too big (``recycle``): no new work; once idle it
  is asked to exit (EXITING).
- EXITING: asked to exit (``asked_to_exit``); SIGKILLed if still there ``RECYCLE_GRACE_S``
  later (``overdue_exits``).
- WAITING: its worker died; a replacement starts once its backoff is over (``due``).
- STARTING: a replacement was started (``started``) and has not said it is ready; past the
  start timeout it is killed (``overdue_starts``), and its death counts as a failed start.
- GIVEN_UP: ``MAX_RESPAWN_FAILURES`` starts failed in a row: the slot stays empty.
- PARKED: an elastic pool's slot with no worker, by choice: it has not joined the pool yet, or its
  worker left it (``leave``: DRAINING, then EXITING, then PARKED on its death, not replaced).
  ``join`` plans a start at once (WAITING); from there it goes as a replacement does.

Deaths the scheduler caused (a timeout, recycling) are expected: they blame no task. A
replacement killed for its start timeout may still report ready or failed from its pipe:
those reports are ignored (``ready``/``start_failed`` return False).

Used from the scheduler's thread only (no lock of its own).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

# A worker slot whose replacement fails to start this many times in a row is given up.
MAX_RESPAWN_FAILURES = 5
# A worker asked to exit (recycling) that is still alive this long after is SIGKILLed: a thread or
# process its dataset started (not a daemon one) keeps it from ending, and it would hold its slot for good.
RECYCLE_GRACE_S = 10.0
# Seconds before retrying a failed start: doubling from the first, up to the last.
RESPAWN_BACKOFF_S = (0.5, 30.0)


class SlotState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    EXITING = "exiting"
    WAITING = "waiting"
    STARTING = "starting"
    GIVEN_UP = "given up"
    PARKED = "parked"


@dataclass(frozen=True)
class SlotView:
    """One slot as it is now: its state, its failed starts in a row, and its state's time (EXITING: when
    it was asked, None once killed; WAITING: when the next start is due, None: not planned; STARTING:
    when it started; else None)."""

    state: SlotState
    failed_starts: int
    at: float | None


@dataclass
class _Slot:
    state: SlotState = SlotState.SERVING
    at: float | None = None
    failed_starts: int = 0
    tasks_done: int = 0
    leaving: bool = False  # its worker leaves an elastic pool: PARKED once it dies, not replaced


class WorkerLifecycle:
    """The states of a pool's ``size`` slots: the first ``serving`` SERVING (all by default), the others PARKED."""

    def __init__(self, size: int, clock: Callable[[], float] = time.monotonic, serving: int | None = None) -> None:
        first = size if serving is None else serving
        self._slots = {worker_id: _Slot() if worker_id < first else _Slot(SlotState.PARKED) for worker_id in range(size)}
        self._clock = clock
        self._expected: set[tuple[int, int]] = set()  # (slot, generation) the scheduler ended itself
        self._start_killed: set[tuple[int, int]] = set()  # (slot, generation) killed past its start timeout
        self.lost = False  # the pool can start no worker again (its fork server is gone): nothing is retried

    def view(self, worker_id: int) -> SlotView:
        slot = self._slots[worker_id]
        return SlotView(slot.state, slot.failed_starts, slot.at)

    def given_up(self) -> frozenset[int]:
        return frozenset(w for w, slot in self._slots.items() if slot.state is SlotState.GIVEN_UP)

    def parked(self) -> frozenset[int]:
        return frozenset(w for w, slot in self._slots.items() if slot.state is SlotState.PARKED)

    def leaving(self) -> frozenset[int]:
        return frozenset(w for w, slot in self._slots.items() if slot.leaving)

    def members(self) -> list[int]:
        """The slots in the pool: neither parked, given up nor leaving (a member may be starting, or waiting to)."""
        return [w for w, slot in self._slots.items() if slot.state not in (SlotState.PARKED, SlotState.GIVEN_UP) and not slot.leaving]

    # ------------------------------------------------------------ an elastic pool's size

    def join(self, worker_id: int) -> None:
        """PARKED -> WAITING, its start due now: the slot joins the pool (its start may fail like a replacement's)."""
        slot = self._slots[worker_id]
        assert slot.state is SlotState.PARKED, slot.state
        slot.state, slot.at, slot.failed_starts = SlotState.WAITING, self._clock(), 0

    def leave(self, worker_id: int) -> None:
        """SERVING -> DRAINING, leaving: no new work, asked to exit once idle, PARKED when it dies."""
        self.recycle(worker_id)
        self._slots[worker_id].leaving = True

    def takes_work(self, worker_id: int) -> bool:
        """Whether new tasks may go to the slot's worker (one being recycled only finishes what it has)."""
        return self._slots[worker_id].state not in (SlotState.DRAINING, SlotState.EXITING)

    # ------------------------------------------------------------ serving and recycling

    def task_done(self, worker_id: int) -> int:
        """Count a finished task of the slot's worker; returns how many it has done."""
        slot = self._slots[worker_id]
        slot.tasks_done += 1
        return slot.tasks_done

    def recycle(self, worker_id: int) -> None:
        """-> DRAINING: no new work; ``exit_when_idle`` says when to ask it to exit."""
        slot = self._slots[worker_id]
        slot.state, slot.at = SlotState.DRAINING, None

    def exit_when_idle(self, worker_id: int, idle: bool) -> bool:
        """Whether to ask the draining slot's worker to exit now (it is idle and was not asked yet)."""
        return idle and self._slots[worker_id].state is SlotState.DRAINING

    def asked_to_exit(self, worker_id: int, generation: int) -> None:
        """DRAINING -> EXITING: its death (of ``generation``) is expected."""
        slot = self._slots[worker_id]
        slot.state, slot.at = SlotState.EXITING, self._clock()
        self._expected.add((worker_id, generation))

    def overdue_exits(self) -> list[int]:
        """The EXITING slots asked more than ``RECYCLE_GRACE_S`` ago; each is reported once (it is then killed)."""
        now, grace = self._clock(), RECYCLE_GRACE_S
        overdue = [w for w, slot in self._slots.items() if slot.state is SlotState.EXITING and slot.at is not None and now - slot.at > grace]
        for worker_id in overdue:
            self._slots[worker_id].at = None  # killed once; its death is expected already
        return overdue

    def killed(self, worker_id: int, generation: int) -> None:
        """The scheduler killed the slot's worker (a task past its timeout): its death blames no task."""
        self._expected.add((worker_id, generation))

    def has_exiting(self) -> bool:
        return any(slot.state is SlotState.EXITING and slot.at is not None for slot in self._slots.values())

    # ------------------------------------------------------------ death and replacement

    def died(self, worker_id: int, generation: int) -> bool:
        """The slot's worker (``generation``) died: the slot waits for a replacement (``respawn``).
        Returns whether the scheduler caused the death."""
        expected = (worker_id, generation) in self._expected
        self._expected.discard((worker_id, generation))
        self._start_killed.discard((worker_id, generation))
        slot = self._slots[worker_id]
        slot.tasks_done = 0
        if slot.leaving:
            slot.state, slot.at, slot.leaving = SlotState.PARKED, None, False  # left the pool: not replaced
        elif slot.state is not SlotState.GIVEN_UP:
            slot.state, slot.at = SlotState.WAITING, None  # ``respawn`` plans the start
        return expected

    def respawn(self, worker_id: int) -> int | None:
        """Plan the slot's next start: now, or after the backoff of its failed starts. Returns the
        failed starts that gave the slot up (GIVEN_UP), else None. A PARKED slot plans nothing."""
        slot = self._slots[worker_id]
        if slot.state is SlotState.PARKED:
            return None
        if self.lost:
            slot.state, slot.at = SlotState.WAITING, None  # never started again
            return None
        if slot.failed_starts >= MAX_RESPAWN_FAILURES:
            slot.state, slot.at = SlotState.GIVEN_UP, None
            return slot.failed_starts
        first, most = RESPAWN_BACKOFF_S
        delay = 0.0 if slot.failed_starts == 0 else min(most, first * 2 ** (slot.failed_starts - 1))
        slot.state, slot.at = SlotState.WAITING, self._clock() + delay
        return None

    def due(self) -> list[int]:
        """The WAITING slots whose start is due; each counts a start (failed until its worker is ready)."""
        now = self._clock()
        due = [w for w, slot in self._slots.items() if slot.state is SlotState.WAITING and slot.at is not None and slot.at <= now]
        for worker_id in due:
            self._slots[worker_id].failed_starts += 1
        return due

    def started(self, worker_id: int) -> None:
        """WAITING -> STARTING: a replacement is on its way."""
        slot = self._slots[worker_id]
        slot.state, slot.at = SlotState.STARTING, self._clock()

    def ready(self, worker_id: int, generation: int) -> bool:
        """The replacement said it is ready: SERVING, its failed starts forgotten. False (nothing changes)
        for one killed past its start timeout, whose report was still in its pipe."""
        if (worker_id, generation) in self._start_killed:
            return False
        slot = self._slots[worker_id]
        slot.failed_starts = 0
        if slot.state is SlotState.STARTING:
            slot.state, slot.at = SlotState.SERVING, None
        return True

    def start_failed(self, worker_id: int, generation: int) -> bool:
        """The replacement could not build its datasets. False for one killed past its start timeout
        (its death starts the next try); True: the caller plans the next start (``respawn``)."""
        if (worker_id, generation) in self._start_killed:
            return False
        slot = self._slots[worker_id]
        if slot.state is SlotState.STARTING:
            slot.state, slot.at = SlotState.WAITING, None
        return True

    def has_starting(self) -> bool:
        return any(slot.state is SlotState.STARTING for slot in self._slots.values())

    def overdue_starts(self, limit: float) -> list[int]:
        """The STARTING slots started more than ``limit`` s ago (each reported once: ``start_killed`` next)."""
        now = self._clock()
        return [w for w, slot in self._slots.items() if slot.state is SlotState.STARTING and slot.at is not None and now - slot.at > limit]

    def start_killed(self, worker_id: int, generation: int) -> None:
        """The overdue replacement (``generation``) was SIGKILLed: what it still reports is ignored,
        and its death brings the next start."""
        self._start_killed.add((worker_id, generation))
        slot = self._slots[worker_id]
        slot.state, slot.at = SlotState.WAITING, None  # its death plans the next start

    def pool_lost(self) -> None:
        """The pool can start no worker again: no start is tried any more."""
        self.lost = True
        for slot in self._slots.values():
            if slot.state is SlotState.WAITING:
                slot.at = None
