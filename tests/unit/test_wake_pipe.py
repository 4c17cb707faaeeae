"""The scheduler's wake-up pipe (server/scheduling/wake_pipe.py): coalesced, drained, and never lost."""

from __future__ import annotations

import select

import pytest

from loaderd.server.scheduling.wake_pipe import WakePipe

pytestmark = pytest.mark.timeout(10)


def readable(pipe: WakePipe) -> bool:
    return bool(select.select([pipe.readable], [], [], 0)[0])


def test_wakes_coalesce_into_one_byte_that_a_drain_takes() -> None:
    pipe = WakePipe()
    assert not readable(pipe)
    for _ in range(100):
        pipe.wake()
    assert readable(pipe)
    pipe.drain()
    assert not readable(pipe)
    pipe.drain()  # nothing came since: nothing to read
    pipe.wake()
    assert readable(pipe), "a wake after a drain is seen by the next wait"
    pipe.drain()
    assert not readable(pipe)
