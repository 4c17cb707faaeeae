"""WorkerLifecycle: a pool slot's states and the rules between them, on a clock the test moves."""

from __future__ import annotations

import pytest
from support.fakes import FakeClock

import loaderd.server.scheduling.lifecycle as lifecycle_module
from loaderd.server.scheduling.lifecycle import MAX_RESPAWN_FAILURES, SlotState, WorkerLifecycle


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


def test_a_death_plans_a_start_now_and_a_ready_replacement_serves(clock: FakeClock) -> None:
    slots = WorkerLifecycle(2, clock)
    assert slots.view(0).state is SlotState.SERVING and slots.takes_work(0)
    assert slots.died(0, 1) is False, "not a death the scheduler caused"
    assert slots.respawn(0) is None
    assert slots.due() == [0]
    slots.started(0)
    assert slots.view(0).state is SlotState.STARTING and slots.has_starting()
    assert slots.ready(0, 2) is True
    assert slots.view(0) == lifecycle_module.SlotView(SlotState.SERVING, 0, None)
    assert slots.view(1).state is SlotState.SERVING


def test_failed_starts_back_off_then_give_the_slot_up(clock: FakeClock) -> None:
    slots = WorkerLifecycle(1, clock)
    slots.died(0, 1)
    waits = []
    for attempt in range(1, MAX_RESPAWN_FAILURES + 1):
        assert slots.respawn(0) is None
        at = slots.view(0).at
        assert at is not None
        waits.append(at - clock.now)
        clock.now += 60
        assert slots.due() == [0]
        slots.started(0)
        assert slots.start_failed(0, attempt + 1) is True
        assert slots.view(0).failed_starts == attempt
    assert waits == [0.0, 0.5, 1.0, 2.0, 4.0]
    assert slots.respawn(0) == MAX_RESPAWN_FAILURES
    assert slots.view(0).state is SlotState.GIVEN_UP and slots.given_up() == {0}
    assert slots.due() == []


def test_a_replacement_killed_past_its_start_timeout_stays_a_failed_start(clock: FakeClock) -> None:
    slots = WorkerLifecycle(1, clock)
    slots.died(0, 1)
    slots.respawn(0)
    slots.due()
    slots.started(0)
    clock.now += 5
    assert slots.overdue_starts(10) == []
    clock.now += 6
    assert slots.overdue_starts(10) == [0]
    slots.start_killed(0, 2)
    assert slots.overdue_starts(10) == [], "reported once"
    assert slots.ready(0, 2) is False and slots.start_failed(0, 2) is False, "its reports from the pipe are ignored"
    assert slots.view(0).failed_starts == 1
    assert slots.died(0, 2) is False
    slots.respawn(0)
    assert slots.view(0).state is SlotState.WAITING and slots.view(0).at == clock.now + 0.5


def test_recycling_drains_then_asks_once_then_kills_after_the_grace(clock: FakeClock) -> None:
    slots = WorkerLifecycle(1, clock)
    assert [slots.task_done(0) for _ in range(3)] == [1, 2, 3]
    slots.recycle(0)
    assert not slots.takes_work(0)
    assert slots.exit_when_idle(0, idle=False) is False
    assert slots.exit_when_idle(0, idle=True) is True
    slots.asked_to_exit(0, 1)
    assert slots.exit_when_idle(0, idle=True) is False, "asked once"
    assert not slots.takes_work(0) and slots.has_exiting()
    clock.now += lifecycle_module.RECYCLE_GRACE_S + 1
    assert slots.overdue_exits() == [0]
    assert slots.overdue_exits() == [] and not slots.has_exiting(), "killed once"
    assert slots.died(0, 1) is True, "a death the scheduler caused"
    assert slots.task_done(0) == 1, "the replacement counts from zero"


def test_a_lost_pool_starts_nothing_again(clock: FakeClock) -> None:
    slots = WorkerLifecycle(2, clock)
    slots.died(0, 1)
    slots.respawn(0)
    slots.pool_lost()
    assert slots.due() == []
    slots.died(1, 1)
    assert slots.respawn(1) is None and slots.due() == []
    assert slots.given_up() == frozenset()


def test_a_killed_task_makes_its_workers_death_expected(clock: FakeClock) -> None:
    slots = WorkerLifecycle(1, clock)
    slots.killed(0, 3)
    assert slots.died(0, 2) is False, "another generation"
    assert slots.died(0, 3) is True
