"""CopyFence (pinned slots go back after their queued GPU copies) and SharedMapping's unmap hooks.

The fence runs against fake events here (this machine has no GPU; the real
thing runs in test_shm.py's CUDA tests); the mappings are real.
"""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import time

import pytest
from support.daemons import wait_for

from loaderd.shm.copy_fence import CopyFence
from loaderd.wire.mapping import SharedMapping

pytestmark = pytest.mark.timeout(30)


class FakeEvent:
    """A recorded event that completes when the test says so."""

    def __init__(self, done: bool = False) -> None:
        self.done = threading.Event()
        if done:
            self.done.set()

    def query(self) -> bool:
        return self.done.is_set()


class FakeGpu:
    """Hands out one event per ``defer``; ``fail`` makes recording raise (CUDA torn down)."""

    def __init__(self, idle: bool = False) -> None:
        self.idle = idle
        self.fail = False
        self.events: list[FakeEvent] = []

    def record(self) -> list[FakeEvent]:
        if self.fail:
            raise RuntimeError("CUDA error: driver shutting down")
        event = FakeEvent(done=self.idle)
        self.events.append(event)
        return [event]


def test_an_idle_gpu_releases_inline() -> None:
    gpu = FakeGpu(idle=True)
    fence = CopyFence(gpu.record)
    released: list[int] = []
    fence.defer(lambda: released.append(1))
    assert released == [1]
    fence.close()


def test_a_release_waits_for_the_copy_queued_before_it() -> None:
    gpu = FakeGpu()
    fence = CopyFence(gpu.record)
    released: list[int] = []
    fence.defer(lambda: released.append(1))
    time.sleep(0.05)
    assert released == [], "released while its copy was still queued"
    gpu.events[0].done.set()
    wait_for(lambda: released == [1], 5.0, "releases [1]", poll=0.001)
    fence.close()


def test_releases_run_in_order_and_none_overtakes_a_pending_one() -> None:
    gpu = FakeGpu()
    fence = CopyFence(gpu.record)
    released: list[int] = []
    for i in range(3):
        fence.defer(lambda i=i: released.append(i))
    gpu.events[1].done.set()  # a later event completing first changes nothing
    time.sleep(0.05)
    assert released == []
    gpu.events[0].done.set()
    wait_for(lambda: released == [0, 1], 5.0, "releases [0, 1]", poll=0.001)
    gpu.events[2].done.set()
    wait_for(lambda: released == [0, 1, 2], 5.0, "releases [0, 1, 2]", poll=0.001)
    fence.close()


def test_close_waits_a_bounded_time_then_releases_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    import loaderd.shm.copy_fence as copy_fence

    monkeypatch.setattr(copy_fence, "_CLOSE_WAIT_S", 0.2)
    gpu = FakeGpu()
    fence = CopyFence(gpu.record)
    released: list[int] = []
    fence.defer(lambda: released.append(1))
    fence.defer(lambda: released.append(2))
    t0 = time.monotonic()
    fence.close()
    assert released == [1, 2]
    assert time.monotonic() - t0 < 2.0
    fence.close()  # idempotent
    fence.defer(lambda: released.append(3))  # after close: at once
    assert released == [1, 2, 3]


def test_a_broken_gpu_releases_at_once() -> None:
    gpu = FakeGpu()
    gpu.fail = True
    fence = CopyFence(gpu.record)
    released: list[int] = []
    fence.defer(lambda: released.append(1))
    assert released == [1]
    fence.close()


def test_a_failing_release_does_not_stop_the_others() -> None:
    gpu = FakeGpu()
    fence = CopyFence(gpu.record)
    released: list[int] = []

    def boom() -> None:
        raise ConnectionError("session gone")

    fence.defer(boom)
    fence.defer(lambda: released.append(2))
    for event in gpu.events:
        event.done.set()
    wait_for(lambda: released == [2], 5.0, "releases [2]", poll=0.001)
    fence.close()


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_unmap_hooks_run_while_the_range_is_still_mapped_after_the_last_view() -> None:
    with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.truncate(1 << 20)
        mapping = SharedMapping(f.fileno(), 1 << 20, writable=True)
    seen: list[tuple[int, int, bool]] = []
    mapping.before_unmap(lambda address, size: seen.append((address, size, _mapped(address))))
    address = mapping.address
    view = mapping.view[:16]
    view[0] = 7
    del mapping  # the mapping object goes; the slice still views the range
    gc.collect()
    assert seen == [] and _mapped(address) and view[0] == 7
    del view
    gc.collect()
    assert seen == [(address, 1 << 20, True)]
    assert not _mapped(address)
