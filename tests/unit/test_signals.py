"""server/app/signals.py: SIGTERM and SIGINT reach `loaderd serve`'s loop without the handler taking a lock.

Before, the handler set threading.Events that the interrupted main thread may
be inside of (``woken.wait()``): Event.set() then waited for a lock its own
thread held, forever, and the daemon ignored SIGTERM (a CI run hung in
test_notify). The real daemon's SIGTERM path is covered by test_notify and
test_daemon; these tests drive the relay directly.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from support.daemons import ends_on_its_own_thread

from loaderd.server.app.signals import StopSignals


@pytest.fixture
def signals() -> Iterator[StopSignals]:
    relay = StopSignals()
    relay.start()  # the relay without install(): no process-wide handlers in pytest
    yield relay
    relay.close()
    assert not relay._thread.is_alive()


@pytest.mark.timeout(30)
def test_the_handler_returns_while_the_interrupted_thread_holds_the_events_locks(signals: StopSignals) -> None:
    # What a signal arriving inside woken.wait() (or stop.wait() while draining) does: the
    # handler runs on the thread that holds those events' locks. On a thread of its own,
    # so that a deadlock fails the test instead of hanging it.
    def interrupted() -> None:
        with signals.woken._cond, signals.stop._cond, signals.drain._cond:
            signals.handle(signal.SIGTERM, None)

    ends_on_its_own_thread(interrupted, 10, "the signal handler waited for a lock its own thread holds")
    assert signals.woken.wait(10) and signals.drain.is_set() and not signals.stop.is_set()


@pytest.mark.timeout(30)
def test_sigterm_drains_and_a_second_sigterm_or_sigint_stops(signals: StopSignals) -> None:
    signals.handle(signal.SIGTERM, None)
    assert signals.woken.wait(10) and signals.drain.is_set() and not signals.stop.is_set()
    signals.handle(signal.SIGTERM, None)
    assert signals.stop.wait(10)
    other = StopSignals()
    other.handle(signal.SIGINT, None)  # before start(): it waits in the queue
    other.start()
    try:
        assert other.stop.wait(10) and not other.drain.is_set()
    finally:
        other.close()
    assert not other._thread.is_alive(), "close() ends the relay"
