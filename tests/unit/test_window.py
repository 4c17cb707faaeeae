"""A loader's window (client/epoch/window.py): torch's prefetch_factor as given; by default the daemon may work
8 batches per worker ahead (16 once the loader knows its batches are small), and a map-style loader plans fewer
for large batches (64 MiB per worker), never under torch's 2 per worker, and 2 per worker until it has received a
batch; the bytes of its first batch are what it goes by (client/wire/array_bytes.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loaderd.epoch.window import BatchBytes, map_prefetch, planned_window, window_size
from loaderd.wire.array_bytes import array_bytes

pytestmark = pytest.mark.timeout(10)

MB = 10**6


def test_a_given_prefetch_factor_is_torch_s() -> None:
    assert window_size(2, 3) == 6
    assert window_size(1, 0) == 1  # at least one worker
    # (and its lanes plan all of it, whatever the batches weigh: tests/unit/test_fleet.py)


def test_the_daemon_may_work_8_per_worker_ahead_by_default_and_4_per_iterable_replica() -> None:
    assert window_size(None, 2) == 16
    assert window_size(None, 0) == 8
    assert window_size(None, 2, iterable=True) == 8
    assert window_size(None, 0, iterable=True) == 4
    assert window_size(None, 2, iterable=True, per_worker=16) == 8  # an iterable's credit is per replica
    assert window_size(3, 2, per_worker=16) == 6  # a given prefetch_factor is torch's


@pytest.mark.parametrize(
    ("batch_bytes", "per_worker"),
    [
        (None, 8),  # none seen yet
        (0, 8),  # no arrays counted (bytes, strings): their size is unknown
        (1024, 16),  # bench_loaders' tiny: 32 x 8 floats
        (4 << 20, 16),  # 16 of them are the 64 MiB a worker plans at most
        ((4 << 20) + 1, 8),
        (12_582_912, 8),  # f32 3x64x64 x 256: as before, whatever it plans within
    ],
)
def test_a_loader_that_knows_its_batches_are_small_opens_16_per_worker(batch_bytes: int | None, per_worker: int) -> None:
    assert map_prefetch(batch_bytes) == per_worker
    bound = window_size(None, 2, per_worker=map_prefetch(batch_bytes))
    assert bound == 2 * per_worker
    if per_worker == 16:
        assert planned_window(bound, batch_bytes) == bound  # a small loader's later epochs plan all of it


@pytest.mark.parametrize(("workers", "window"), [(1, 16), (4, 64), (5, 64), (8, 64), (9, 72), (16, 128)])
def test_small_batches_depth_stops_at_the_daemon_s_default_max_window(workers: int, window: int) -> None:
    """Past 64 (the daemon's default ``max_window``) the daemon would cap it unseen: 16 a worker up to 64 in all,
    never under the 8 a worker of larger batches."""
    bound = window_size(None, workers, per_worker=16)
    assert bound == window
    assert planned_window(bound, 1024) == bound


@pytest.mark.parametrize(
    ("workers", "batch_bytes", "window"),
    [
        (2, None, 4),  # no batch seen yet: torch's depth
        (0, None, 2),  # a daemon with no pool size known: one worker's
        (2, 128, 32),  # tiny batches: the full default (16 a worker, their bytes known)
        (2, 0, 16),  # no arrays (or a structure that could not be counted): 8 a worker, all planned
        (2, 12_582_912, 10),  # bench_loaders' float32 3x64x64 x 256: 10 fit in 2 x 64 MiB
        (2, 9_633_792, 13),  # its uint8 3x224x224 x 64
        (2, 38_535_680, 4),  # the image pipeline's float32 64x3x224x224: 3 fit, torch's 4 is the least
        (4, 38_535_680, 8),  # 4 workers: 6 fit, torch's 8
        (2, 30 * MB, 4),  # 4 fit
        (4, 20 * MB, 13),  # between the two
    ],
)
def test_the_plan_follows_the_batches_bytes(workers: int, batch_bytes: int | None, window: int) -> None:
    bound = window_size(None, workers, per_worker=map_prefetch(batch_bytes))
    assert planned_window(bound, batch_bytes) == window
    assert window <= bound  # never past what the daemon was told


class SelfHolding(list):  # a user's collate may return anything
    pass


def test_a_loader_keeps_the_bytes_of_its_first_batch() -> None:
    seen = BatchBytes()
    assert seen.known is None
    first = {"image": torch.zeros(4, 3, dtype=torch.float32), "label": np.zeros(4, dtype=np.int64), "name": ["a"] * 4}
    assert seen.note(first) is True
    assert seen.known == 4 * 3 * 4 + 4 * 8
    assert seen.note(torch.zeros(1000)) is False  # a last, short batch (or any later one) changes nothing
    assert seen.known == 48 + 32
    odd = SelfHolding()
    odd.append(odd)
    other = BatchBytes()
    assert other.note(odd) is True and other.known == 0  # counted as nothing, not raised into next()


def test_array_bytes_counts_arrays_only() -> None:
    assert array_bytes((torch.zeros(2, 2, dtype=torch.float64), [np.ones(3, dtype=np.uint8)])) == 32 + 3
    assert array_bytes([1, 2.0, "text", b"bytes", None]) == 0
    assert array_bytes(torch.zeros(10)[::2]) == 5 * 4  # a view counts its own elements
