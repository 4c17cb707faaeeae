"""SlotWriter (server/worker/slot_writer.py): a worker's segments follow what is in flight, not the most ever held."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from support.fakes import FakeClock

from loaderd.server.shm.arena import INLINE_BYTES
from loaderd.server.worker.slot_writer import IDLE_SEGMENT_S, SlotWriter
from loaderd.wire.limits import SHM_DIR

pytestmark = pytest.mark.timeout(30)



@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def writer(clock: FakeClock) -> Iterator[SlotWriter]:
    slots = SlotWriter(f"ld-unit-slots-{os.getpid()}-", 1 << 30, clock=clock)
    yield slots
    slots.close(unlink=True)


def take(writer: SlotWriter, nbytes: int = INLINE_BYTES) -> str:
    acquired = writer.acquire(nbytes)
    assert acquired is not None
    return acquired[0]


def test_a_batch_takes_the_segment_freed_last_so_the_others_stay_unused(writer: SlotWriter, clock: FakeClock) -> None:
    a, b, c = take(writer), take(writer), take(writer)
    for name in (a, b, c):
        writer.release(name)
        clock.now += 1
    assert take(writer) == c
    writer.release(c)
    assert take(writer) == c


def test_a_segment_unused_for_a_while_goes_while_the_worker_is_busy(writer: SlotWriter, clock: FakeClock) -> None:
    a, b = take(writer), take(writer)  # a burst: two batches in flight at once
    writer.release(a)
    writer.release(b)
    for _ in range(int(IDLE_SEGMENT_S) + 2):  # then one at a time, a batch a second
        clock.now += 1
        name = take(writer)
        writer.release(name)
    assert name == b and writer.retired == [a]
    assert not os.path.exists(os.path.join(SHM_DIR, a)) and os.path.exists(os.path.join(SHM_DIR, b))


def test_a_smaller_free_segment_that_fits_wins_over_a_larger_one_freed_later(writer: SlotWriter, clock: FakeClock) -> None:
    small = take(writer, INLINE_BYTES)
    large = take(writer, 64 * INLINE_BYTES)
    writer.release(small)
    clock.now += 1
    writer.release(large)
    assert take(writer, INLINE_BYTES) == small


def test_a_release_already_on_its_way_is_taken_before_a_new_segment_is_made(clock: FakeClock) -> None:
    """The client gave the last batch's segment back while the next batch was made: that batch reuses it."""
    on_the_way: list[str] = []

    def freed() -> list[str]:
        names = list(on_the_way)
        on_the_way.clear()
        return names

    writer = SlotWriter(f"ld-unit-freed-{os.getpid()}-", 1 << 30, clock=clock, freed=freed)
    try:
        first = take(writer)
        on_the_way.append(first)
        assert take(writer) == first
        second = take(writer)  # nothing given back meanwhile: a second segment
        assert second != first
    finally:
        writer.close(unlink=True)


def test_the_newest_release_in_the_pipe_is_reused_so_a_burst_leaves_no_extra_segment(clock: FakeClock) -> None:
    """Each release is still in the pipe when the next batch starts, an older free segment at hand: the batch takes
    the one in the pipe, and the burst's extra segment idles and goes (taking the older one kept both in rotation)."""
    on_the_way: list[str] = []

    def freed() -> list[str]:
        names = list(on_the_way)
        on_the_way.clear()
        return names

    writer = SlotWriter(f"ld-unit-newest-{os.getpid()}-", 1 << 30, clock=clock, freed=freed)
    try:
        a, b = take(writer), take(writer)  # a burst: two batches in flight at once
        writer.release(a)  # a's release came with a task
        on_the_way.append(b)
        for _ in range(int(IDLE_SEGMENT_S) + 2):  # then one batch in flight at a time, a batch a second
            clock.now += 1
            assert take(writer) == b
            on_the_way.append(b)
        assert writer.retired == [a]
        assert not os.path.exists(os.path.join(SHM_DIR, a)) and os.path.exists(os.path.join(SHM_DIR, b))
    finally:
        writer.close(unlink=True)


def test_trim_keeps_the_segments_freed_last_and_those_in_use(writer: SlotWriter, clock: FakeClock) -> None:
    """threads: auto trims when its count goes down, keeping the free segment freed last for the next batch."""
    a, b, c, d = take(writer), take(writer), take(writer), take(writer)
    for name in (a, b, c):
        writer.release(name)
        clock.now += 1
    writer.trim(keep=1)
    assert writer.retired == [a, b]
    assert [os.path.exists(os.path.join(SHM_DIR, n)) for n in (a, b, c, d)] == [False, False, True, True]  # d: in use
    assert take(writer) == c
    writer.trim()  # nothing free: nothing goes
    assert writer.retired == [a, b]
