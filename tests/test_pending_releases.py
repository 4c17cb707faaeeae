"""PendingReleases: leases wait for a plan of their stream, else go out after one to two ticks."""

from __future__ import annotations

import gc

import pytest

from loaderd.pending_releases import PendingReleases

pytestmark = pytest.mark.timeout(10)


def test_the_first_release_wakes_the_sender_and_later_ones_do_not() -> None:
    pending = PendingReleases()
    assert pending.add(1, token=7) is True
    assert pending.add(2, token=7) is False
    assert pending.add(3, token=8) is False


def test_a_plan_takes_its_own_streams_leases_only() -> None:
    pending = PendingReleases()
    pending.add(1, token=7)
    pending.add(2, token=8)
    pending.add(3, token=7)
    assert pending.take(7) == [1, 3]
    assert pending.take(7) == []
    assert pending.tick() == ([], True)  # lease 2 has now waited one tick
    assert pending.tick() == ([2], False)


def test_a_lease_no_plan_takes_goes_out_on_the_second_tick_and_then_the_sender_sleeps() -> None:
    pending = PendingReleases()
    pending.add(1, token=7)
    assert pending.tick() == ([], True)
    pending.add(2, token=7)  # the sender ticks already: no wake
    assert pending.tick() == ([1], True)
    assert pending.tick() == ([2], False)
    assert pending.add(3, token=7) is True  # asleep again: the next release wakes it


def test_a_plan_takes_leases_of_both_generations_oldest_first() -> None:
    pending = PendingReleases()
    pending.add(1, token=7)
    pending.tick()
    pending.add(2, token=7)
    assert pending.take(7) == [1, 2]
    assert pending.tick() == ([], False)


def test_an_abandoned_streams_leases_are_dropped() -> None:
    pending = PendingReleases()
    pending.add(1, token=7)
    pending.tick()
    pending.add(2, token=7)
    pending.add(3, token=8)
    pending.drop(7)
    assert pending.take(7) == []
    assert pending.tick() == ([], True)
    assert pending.tick() == ([3], False)


def test_releases_that_reenter_from_garbage_collections_are_neither_lost_nor_sent_twice() -> None:
    """Finalizers (releases) run inside garbage collections, on whatever thread allocates: here a
    collection runs at nearly every allocation, inside add, take and tick, and releases more."""
    pending = PendingReleases()
    added: list[int] = []
    got: list[int] = []
    leases = iter(range(1, 1_000_000))

    def release_more(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and len(added) < 5000:
            lease = next(leases)
            added.append(lease)
            pending.add(lease, token=lease % 3)

    threshold = gc.get_threshold()
    gc.callbacks.append(release_more)
    gc.set_threshold(1)
    try:
        for i in range(2000):
            lease = next(leases)
            added.append(lease)
            pending.add(lease, token=lease % 3)
            if i % 3 == 0:
                got.extend(pending.take(i % 3))
            if i % 5 == 0:
                got.extend(pending.tick()[0])
    finally:
        gc.callbacks.remove(release_more)
        gc.set_threshold(*threshold)
    for _ in range(3):
        got.extend(pending.tick()[0])
    assert len(added) > 2000  # the collections did release
    assert sorted(got) == sorted(added)
    assert pending.tick() == ([], False)
