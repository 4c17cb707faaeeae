"""HeldWakeups: a servicer's wake-up asked after ``hold`` waits for ``wake_held`` (the scheduler about to wait for the
pool); one asked while the scheduler waits goes at once."""

from __future__ import annotations

import pytest

from loaderd.server.scheduling.held_wakeups import HeldWakeups

pytestmark = pytest.mark.timeout(10)


class Stream:
    """A stream's condition as HeldWakeups sees it: it counts its servicer's wake-ups."""

    def __init__(self) -> None:
        self.woken = 0

    def notify_all(self) -> None:
        self.woken += 1


def test_a_wake_up_while_the_scheduler_waits_is_not_held() -> None:
    wakeups, stream = HeldWakeups(), Stream()
    wakeups.wake(stream)
    assert stream.woken == 1


def test_wake_ups_after_hold_wait_for_wake_held() -> None:
    wakeups, a, b = HeldWakeups(), Stream(), Stream()
    wakeups.hold()
    wakeups.wake(a)
    wakeups.wake(b)
    assert (a.woken, b.woken) == (0, 0)
    wakeups.wake_held()
    assert (a.woken, b.woken) == (1, 1)
    wakeups.wake_held()  # nothing held twice
    assert (a.woken, b.woken) == (1, 1)


def test_after_wake_held_wake_ups_go_at_once_until_the_next_hold() -> None:
    wakeups, stream = HeldWakeups(), Stream()
    wakeups.hold()
    wakeups.wake_held()
    wakeups.wake(stream)
    assert stream.woken == 1
    wakeups.hold()
    wakeups.wake(stream)
    assert stream.woken == 1
    wakeups.wake_held()
    assert stream.woken == 2
