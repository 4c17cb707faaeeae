"""Finalizer (client/channel/closer.py): what a dropped object left open is closed on the closer thread."""

from __future__ import annotations

import functools
import gc
import logging
import threading
import weakref
from collections.abc import Callable

import pytest
from support.daemons import wait_for

from loaderd.channel.closer import Finalizer, settle

pytestmark = pytest.mark.timeout(30)


class Owner:
    """Something that leaves work behind when it is dropped: ``_close`` unless told otherwise."""

    def __init__(self, work: list[str], lock: threading.Lock | None = None, close: Callable[..., None] | None = None) -> None:
        self.closer = Finalizer(self, _close, work, lock) if close is None else Finalizer(self, close, work)


def _close(work: list[str], lock: threading.Lock | None) -> None:
    if lock is not None:
        with lock:
            pass
    work.append(threading.current_thread().name)


def test_called_it_runs_at_once_on_the_callers_thread_and_only_once() -> None:
    work: list[str] = []
    owner = Owner(work)
    owner.closer()
    assert work == [threading.current_thread().name]
    owner.closer()
    del owner
    assert settle(5.0)
    assert work == [threading.current_thread().name], "it ran again once its owner was collected"


def test_a_dropped_owner_is_closed_on_the_closer_thread_while_the_dropping_thread_holds_a_lock_it_needs() -> None:
    """A finalizer runs wherever its object dies, locks held: run there, work that takes one of them waits forever
    (a gRPC call's cancel and its state lock, grpc/grpc#36927). Posted, it runs once the lock is let go."""
    work: list[str] = []
    lock = threading.Lock()  # not reentrant: run inline, the drop below would never return
    owner = Owner(work, lock)
    with lock:
        del owner  # the last reference: its finalizer runs here, now
        assert work == []
    assert settle(5.0)
    assert work == ["loaderd-closer"]


def test_one_collected_in_a_cycle_on_another_thread_is_closed_on_the_closer_thread() -> None:
    work: list[str] = []
    owner = Owner(work)
    owner.cycle = owner  # type: ignore[attr-defined]  # only the cycle collector frees it
    del owner
    collector = threading.Thread(target=gc.collect, name="test-collector")
    collector.start()
    collector.join(10.0)
    assert settle(5.0)
    assert work == ["loaderd-closer"]


def test_a_detached_one_never_runs() -> None:
    work: list[str] = []
    owner = Owner(work)
    owner.closer.detach()
    assert not owner.closer.alive
    owner.closer()
    del owner
    assert settle(5.0)
    assert work == []


def _fail(work: list[str]) -> None:
    work.append("failed")
    raise RuntimeError("the daemon is gone")


def test_an_error_in_posted_work_is_logged_and_the_closer_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    work: list[str] = []
    failing = Owner(work, close=_fail)
    after = Owner(work)
    with caplog.at_level(logging.ERROR, logger="loaderd.closer"):
        del failing, after
        assert settle(5.0)
    assert sorted(work) == ["failed", "loaderd-closer"]
    assert "the daemon is gone" in caplog.text


class Held:
    """Something only the posted work refers to (an epoch's queued batches, say)."""


def _close_held(work: list[str], held: Held) -> None:
    work.append(type(held).__name__)


def test_the_closer_keeps_nothing_of_what_it_closed() -> None:
    """Its thread idles until the next work comes: what the last one held must not wait with it (a dropped loader's
    planned window of shared-memory batches did, until test_next_epoch caught it)."""
    work: list[str] = []
    held = Held()
    gone = weakref.ref(held)
    owner = Owner(work, close=functools.partial(_close_held, held=held))
    del held, owner
    # No settle(): the marker it posts would be the last work, and free this one.
    wait_for(lambda: work == ["Held"], 5.0, "the posted work to run")
    wait_for(lambda: gone() is None, 3.0, "the closer thread to let go of the work it ran")


def test_wait_returns_once_it_ran_either_way_or_was_detached() -> None:
    work: list[str] = []
    called, dropped, detached, kept = Owner(work), Owner(work), Owner(work), Owner(work)
    closers = [called.closer, dropped.closer, detached.closer]
    called.closer()
    detached.closer.detach()
    del dropped  # posted: wait() sees it run on the closer thread
    assert all(closer.wait(5.0) for closer in closers)
    assert sorted(work) == sorted([threading.current_thread().name, "loaderd-closer"])
    assert not kept.closer.wait(0.05), "one never run nor detached is not done"
