"""WindowFit (server/scheduling/window_fit.py): a map-style stream's dispatch window for an elastic pool's size and
for the streams sharing the pool, and the scheduler applying it as streams open and close."""

from __future__ import annotations

import dataclasses

import pytest
from support.fakes import FakePool, LedgerLog, catalog, drain, iter_spec, map_spec

from loaderd.server.scheduling.dispatcher import PER_WORKER
from loaderd.server.scheduling.pool_protocol import SchedulerPolicy
from loaderd.server.scheduling.scheduler import Scheduler
from loaderd.server.scheduling.stream import StreamSpec
from loaderd.server.scheduling.window_fit import SHARED_LEAST, WindowFit

pytestmark = pytest.mark.timeout(30)


def test_one_stream_on_a_fixed_pool_keeps_its_window() -> None:
    assert WindowFit().window(16) == 16
    assert WindowFit().window(1) == 1


def test_an_elastic_pool_narrows_to_its_share_but_keeps_its_least() -> None:
    assert WindowFit(share=0.5, least=5).window(16) == 8
    assert WindowFit(share=0.125, least=5).window(16) == 5
    assert WindowFit(share=0.125, least=5).window(3) == 3, "never wider than the client asked"


def test_streams_sharing_the_pool_split_it_down_to_the_shared_least() -> None:
    assert WindowFit(streams=4).window(16) == 4
    assert WindowFit(streams=3).window(16) == 6  # rounded up: the pool is never left short
    assert WindowFit(streams=8).window(8) == SHARED_LEAST
    assert WindowFit(streams=8).window(1) == 1
    assert WindowFit(share=0.5, least=5, streams=2).window(16) == 4


def trainer(name: str, window: int = 16) -> StreamSpec:
    """A map-style stream of training process ``name``."""
    return dataclasses.replace(map_spec(window=window), client=name)


def test_the_scheduler_splits_windows_as_loaders_open_and_widens_them_as_they_close() -> None:
    pool = FakePool(size=4)
    sched = Scheduler(pool, LedgerLog().ledger(), catalog(), SchedulerPolicy())
    try:
        a = sched.open_stream(trainer("host:1"))
        next_epoch = sched.open_stream(trainer("host:1"))  # the same loader's next epoch, opened early: not a second loader
        assert (a.dispatch_window, next_epoch.dispatch_window) == (16, 16)
        sched.close_stream(next_epoch)
        b, c = sched.open_stream(trainer("host:2")), sched.open_stream(trainer("host:3"))
        assert (a.dispatch_window, b.dispatch_window, c.dispatch_window) == (6, 6, 6)
        stream = sched.open_stream(iter_spec(window=16))  # an iterable stream has its own credit: not counted
        assert (a.dispatch_window, b.dispatch_window, c.dispatch_window, stream.dispatch_window) == (6, 6, 6, 16)
        sched.close_stream(stream)
        sched.add_plan(a, [(i,) for i in range(20)], True)
        sched.step(0)
        assert sum(t.stream_id == a.stream_id for _, t in pool.batch_tasks()) == 6, "a third of the pool's window"
        sched.close_stream(b)
        sched.close_stream(c)
        assert a.dispatch_window == 16
        sched.step(0)
        full = min(16, PER_WORKER * pool.size)
        assert sum(t.stream_id == a.stream_id for _, t in pool.batch_tasks()) == full, "the window, or the pool's queues, full"
        for _, task in pool.batch_tasks():
            pool.finish(task)
        sched.step(0)
        assert len(drain(a)) == full
    finally:
        sched.stop()
