"""Leases: dropped leases wait for a plan of their stream, else go out after one to two ticks; abandon."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from loaderd.shm.leases import Leases

pytestmark = pytest.mark.timeout(10)


def dropped(leases: Leases, lease: int, token: int) -> bool:
    """A batch of stream ``token`` arrived in the slot of ``lease`` and the user dropped it."""
    leases.claim(lease, token)
    return leases.release(lease)


def test_the_first_release_wakes_the_sender_and_later_ones_do_not() -> None:
    leases = Leases()
    assert dropped(leases, 1, token=7) is True
    assert dropped(leases, 2, token=7) is False
    assert dropped(leases, 3, token=8) is False


def test_a_plan_takes_its_own_streams_leases_only() -> None:
    leases = Leases()
    dropped(leases, 1, token=7)
    dropped(leases, 2, token=8)
    dropped(leases, 3, token=7)
    assert leases.take(7) == [1, 3]
    assert leases.take(7) == []
    assert leases.tick() == ([], True, True)  # lease 2 has now waited one tick
    assert leases.tick() == ([2], False, False)


def test_a_lease_no_plan_takes_goes_out_on_the_second_tick_and_then_the_sender_sleeps() -> None:
    leases = Leases()
    dropped(leases, 1, token=7)
    assert leases.tick() == ([], True, True)
    assert dropped(leases, 2, token=7) is False  # the sender ticks already: no wake
    assert leases.tick() == ([1], True, True)
    assert leases.tick() == ([2], False, False)
    assert dropped(leases, 3, token=7) is True  # asleep again: the next release wakes it


def test_while_releases_come_the_sender_ticks_on_though_plans_take_them_all() -> None:
    """In a running loop plans carry nearly every lease: the sender ticks at its period rather than being woken
    by each release after a tick that found nothing (two wake-ups where one serves)."""
    leases = Leases()
    assert dropped(leases, 1, token=7) is True
    assert leases.take(7) == [1]
    assert leases.tick() == ([], False, True)  # nothing pending, but the loop runs
    assert dropped(leases, 2, token=7) is False
    assert leases.take(7) == [2]
    assert leases.tick() == ([], False, True)
    assert leases.tick() == ([], False, False)  # a whole period without a release: sleep
    assert dropped(leases, 3, token=7) is True


def test_a_plan_takes_leases_of_both_generations_oldest_first() -> None:
    leases = Leases()
    dropped(leases, 1, token=7)
    leases.tick()
    dropped(leases, 2, token=7)
    assert leases.take(7) == [1, 2]
    assert leases.tick() == ([], False, True)  # lease 2 came since the last tick
    assert leases.tick() == ([], False, False)


def test_a_lease_released_without_a_claim_is_still_sent() -> None:
    leases = Leases()
    assert leases.release(5) is True
    assert leases.take(0) == [5]  # no stream's plan would carry it; the session does


def test_an_abandoned_stream_forgets_its_dropped_leases_and_lists_those_still_claimed() -> None:
    leases = Leases()
    dropped(leases, 1, token=7)
    leases.tick()
    dropped(leases, 2, token=7)
    leases.claim(3, 7)  # still held by the user
    dropped(leases, 4, token=8)
    leases.claim(5, 8)
    assert leases.abandon(7) == [3]  # the daemon takes 1 and 2 back itself
    assert leases.take(7) == []
    assert leases.tick() == ([], True, True)
    assert leases.tick() == ([4], False, False)
    assert leases.release(3) is True  # a kept lease still goes back, on the session
    assert leases.take(7) == [3]
    assert leases.claimed() == {5: 8}


def test_a_release_racing_an_abandon_is_either_given_back_by_it_or_sent() -> None:
    """Whatever the interleaving, every lease of an abandoned stream goes back exactly once: not kept
    (the abandonment takes it) or kept and then sent (as a release)."""
    for _ in range(200):
        leases = Leases()
        for lease in range(1, 9):
            leases.claim(lease, 7)
        go = threading.Barrier(2)

        def drop_all() -> None:
            go.wait()
            for lease in range(1, 9):
                leases.release(lease)

        thread = threading.Thread(target=drop_all)
        thread.start()
        go.wait()
        kept = leases.abandon(7)
        thread.join()
        sent = leases.take(7) + leases.tick()[0] + leases.tick()[0]
        assert set(sent) >= set(kept), (kept, sent)  # a kept lease must be released later


def test_a_sender_asleep_is_woken_for_every_lease_it_has_not_sent() -> None:
    """Whatever the interleaving of a thread's releases with the sender's ticks, the sender goes to sleep only
    when a release will wake it (or nothing is left): run as the session's sender, it sends every lease."""
    for _ in range(50):
        leases = Leases()
        woken = threading.Event()

        def drop_all() -> None:
            for lease in range(1, 40):
                leases.claim(lease, 7)
                if leases.release(lease):
                    woken.set()
                if lease % 4 == 0:
                    time.sleep(0.0002)  # a pause: the sender may fall asleep between releases

        thread = threading.Thread(target=drop_all)
        thread.start()
        sent: list[int] = []
        while True:
            tick = leases.tick()
            sent.extend(tick.due)
            if tick.tick_on:
                continue
            # Asleep: only a release's wake brings the sender back (no tick of its own, which would hide a lease left).
            while not woken.wait(0.001) and thread.is_alive():
                pass
            if not woken.is_set():
                break  # the releases ended and owe no wake
            woken.clear()
        thread.join()
        assert sorted(sent) == list(range(1, 40))


def test_releases_that_reenter_from_garbage_collections_are_neither_lost_nor_sent_twice() -> None:
    """Finalizers (releases) run inside garbage collections, on whatever thread allocates: here a
    collection runs at nearly every allocation, inside claim, release, take, tick and abandon, and
    releases more."""
    leases = Leases()
    claimed: list[int] = []
    got: list[int] = []
    numbers = iter(range(1, 1_000_000))
    abandoned: dict[int, list[int]] = {}

    def release_more(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and len(claimed) < 5000:
            lease = next(numbers)
            claimed.append(lease)
            leases.claim(lease, lease % 3)
            leases.release(lease)

    threshold = gc.get_threshold()
    gc.callbacks.append(release_more)
    gc.set_threshold(1)
    try:
        for i in range(2000):
            lease = next(numbers)
            claimed.append(lease)
            leases.claim(lease, 3 + i % 50 if i % 7 == 0 else lease % 3)
            leases.release(lease)
            if i % 3 == 0:
                got.extend(leases.take(i % 3))
            if i % 5 == 0:
                got.extend(leases.tick()[0])
            if i % 7 == 0:
                abandoned[3 + i % 50] = leases.abandon(3 + i % 50)
    finally:
        gc.callbacks.remove(release_more)
        gc.set_threshold(*threshold)
    for _ in range(3):
        got.extend(leases.tick()[0])
    assert len(claimed) > 2000  # the collections did release
    assert len(got) == len(set(got)), "a lease was sent twice"
    # Every lease was released: sent, or forgotten with its abandoned stream (whose abandonment gives it back).
    forgotten = set(claimed) - set(got)
    assert all(lease not in kept for kept in abandoned.values() for lease in forgotten)
    assert leases.tick() == ([], False, False) and leases.claimed() == {}
