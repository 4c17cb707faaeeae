"""Map-style parity: RemoteDataLoader(name, **kw) yields what DataLoader(dataset, **kw) yields.

Every test builds the same dataset locally (the oracle, iterated by torch's own
single-process DataLoader) and compares batch for batch with what the daemon
produces: same types (namedtuple classes included), dict key order, dtypes,
shapes and values. RNG consumption in the client process must match torch's
too, so a training script's randomness is unchanged by switching loaders.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support import datasets
from support.compare import assert_same, assert_same_batches
from support.daemons import RunningDaemon, running_daemon, tensors_of
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import loaderd
from loaderd import RemoteDataLoader

SQUARES_N = 103
SUMMED_N = 50
# Batches of at least 64 KiB (the daemon's inline threshold) travel through a
# shared-memory slot on the shm transport; the small datasets above always go
# inline. These sizes put every full batch in a slot.
BIG_SQUARES_N = 20480  # 16 bytes a sample: 5120 samples a batch make 80 KiB
BIG_STRUCTURED_N = 1100

DATASETS: dict[str, Any] = {
    "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": SQUARES_N}},
    "structured": {"dataset": "support.datasets:Structured"},
    "augment": {"dataset": "support.datasets:RandomAugment"},
    "summed": {"dataset": "support.datasets:Squares", "kwargs": {"n": SUMMED_N}, "collate_fn": "support.datasets:sum_collate"},
    "squares-big": {"dataset": "support.datasets:Squares", "kwargs": {"n": BIG_SQUARES_N}},
    "structured-big": {"dataset": "support.datasets:Structured", "kwargs": {"n": BIG_STRUCTURED_N}},
}


# ------------------------------------------------------------------ helpers


def rng_state_after(seed: int, run: Any) -> tuple[Any, torch.Tensor]:
    """Seed the global RNG, run ``run()``, and return its result and the next torch.rand(1)."""
    torch.manual_seed(seed)
    result = run()
    return result, torch.rand(1)


def assert_same_epoch_and_rng(loader: Any, expected_loader: DataLoader, seed: int) -> None:
    """An epoch of each after torch.manual_seed(seed): the same batches, and the global RNG left alike."""
    expected, rand_torch = rng_state_after(seed, lambda: list(expected_loader))
    got, rand_remote = rng_state_after(seed, lambda: list(loader))
    assert_same_batches(got, expected)
    assert torch.equal(rand_remote, rand_torch), "RemoteDataLoader consumed the global RNG differently from torch"


# ------------------------------------------------------------------ daemons


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="ld-mp-", workers=2) as running:
        yield running


@pytest.fixture(scope="module")
def daemon_one_worker() -> Iterator[RunningDaemon]:
    with running_daemon({"augment": DATASETS["augment"]}, prefix="ld-mp-", workers=1) as running:
        yield running


@pytest.fixture
def remote(daemon: RunningDaemon, transport: str) -> Any:
    def make(name: str, **kw: Any) -> RemoteDataLoader:
        return RemoteDataLoader(name, address=daemon.address, transport=transport, **kw)

    return make


def squares(n: int = SQUARES_N) -> datasets.Squares:
    return datasets.Squares(n=n)


# ------------------------------------------------------------------ batching


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch_size", [1, 7, 64])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sizes(remote: Any, batch_size: int, drop_last: bool) -> None:
    expected_loader = DataLoader(squares(), batch_size=batch_size, drop_last=drop_last)
    loader = remote("squares", batch_size=batch_size, drop_last=drop_last)
    assert len(loader) == len(expected_loader)
    assert loader.batch_size == batch_size and loader.drop_last == drop_last
    got = list(loader)
    assert len(got) == len(loader)
    assert_same_batches(got, list(expected_loader))


@pytest.mark.timeout(30)
def test_no_automatic_batching(remote: Any) -> None:
    expected_loader = DataLoader(squares(), batch_size=None)
    loader = remote("squares", batch_size=None)
    assert len(loader) == len(expected_loader) == SQUARES_N
    got = list(loader)
    expected = list(expected_loader)
    # default_convert semantics: the (tensor, int) tuple becomes a list, nothing gets a batch dimension.
    assert type(expected[0]) is list and expected[0][0].shape == (2,)
    assert_same_batches(got, expected)


# ------------------------------------------------------------------ shuffling and the client's RNG


@pytest.mark.timeout(30)
@pytest.mark.parametrize("batch_size", [None, 8])
def test_shuffle_with_generator(remote: Any, batch_size: int | None) -> None:
    g_torch = torch.Generator().manual_seed(1234)
    g_remote = torch.Generator().manual_seed(1234)
    expected_loader = DataLoader(squares(), batch_size=batch_size, shuffle=True, generator=g_torch)
    loader = remote("squares", batch_size=batch_size, shuffle=True, generator=g_remote)
    assert len(loader) == len(expected_loader)
    expected, rand_torch = rng_state_after(7, lambda: list(expected_loader))
    got, rand_remote = rng_state_after(7, lambda: list(loader))
    assert_same_batches(got, expected)
    # Both generators were consumed identically (sampler permutation and base seed).
    assert torch.equal(g_torch.get_state(), g_remote.get_state())
    # Neither touched the global RNG.
    torch.manual_seed(7)
    assert torch.equal(rand_torch, torch.rand(1)) and torch.equal(rand_remote, rand_torch)
    # Shuffled for real, and every index exactly once.
    if batch_size is None:
        order = [item[1] for item in got]
    else:
        order = torch.cat([b[1] for b in got]).tolist()
    assert sorted(order) == list(range(SQUARES_N)) and order != list(range(SQUARES_N))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("batch_size", [None, 10])
def test_shuffle_global_rng(remote: Any, batch_size: int | None) -> None:
    expected_loader = DataLoader(squares(), batch_size=batch_size, shuffle=True)
    loader = remote("squares", batch_size=batch_size, shuffle=True)
    assert_same_epoch_and_rng(loader, expected_loader, 2024)


@pytest.mark.timeout(30)
def test_shuffle_three_epochs(remote: Any) -> None:
    expected_loader = DataLoader(squares(), batch_size=16, shuffle=True)
    loader = remote("squares", batch_size=16, shuffle=True)
    expected, rand_torch = rng_state_after(99, lambda: [list(expected_loader) for _ in range(3)])
    got, rand_remote = rng_state_after(99, lambda: [list(loader) for _ in range(3)])
    for epoch in range(3):
        assert_same_batches(got[epoch], expected[epoch])
    orders = [torch.cat([b[1] for b in epoch]).tolist() for epoch in got]
    assert orders[0] != orders[1] != orders[2], "epochs were not reshuffled"
    assert torch.equal(rand_remote, rand_torch)


@pytest.mark.timeout(30)
def test_shuffle_three_epochs_with_generator(remote: Any) -> None:
    g_torch = torch.Generator().manual_seed(5)
    g_remote = torch.Generator().manual_seed(5)
    expected_loader = DataLoader(squares(), batch_size=32, shuffle=True, generator=g_torch)
    loader = remote("squares", batch_size=32, shuffle=True, generator=g_remote)
    for epoch in range(3):
        assert_same_batches(list(loader), list(expected_loader))
        assert torch.equal(g_torch.get_state(), g_remote.get_state()), f"generator diverged after epoch {epoch}"


# ------------------------------------------------------------------ client-side samplers


@pytest.mark.timeout(30)
def test_subset_random_sampler_with_generator(remote: Any) -> None:
    subset = list(range(0, SQUARES_N, 3))
    expected_loader = DataLoader(
        squares(), batch_size=5, sampler=SubsetRandomSampler(subset, generator=torch.Generator().manual_seed(11))
    )
    loader = remote("squares", batch_size=5, sampler=SubsetRandomSampler(subset, generator=torch.Generator().manual_seed(11)))
    assert len(loader) == len(expected_loader)
    for _ in range(2):
        assert_same_epoch_and_rng(loader, expected_loader, 3)


@pytest.mark.timeout(30)
def test_weighted_random_sampler(remote: Any) -> None:
    weights = [float((i % 5) + 1) for i in range(SQUARES_N)]
    expected_loader = DataLoader(squares(), batch_size=6, sampler=WeightedRandomSampler(weights, 40, replacement=True))
    loader = remote("squares", batch_size=6, sampler=WeightedRandomSampler(weights, 40, replacement=True))
    assert len(loader) == len(expected_loader) == 7
    assert_same_epoch_and_rng(loader, expected_loader, 17)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("batch_size", [None, 1, 2])
def test_list_of_indices_as_sampler(remote: Any, batch_size: int | None) -> None:
    sampler = [3, 1, 4, 1, 5, 9, 2, 6, 5, 102, -1]
    expected_loader = DataLoader(squares(), batch_size=batch_size, sampler=sampler)
    loader = remote("squares", batch_size=batch_size, sampler=sampler)
    assert len(loader) == len(expected_loader)
    assert_same_batches(list(loader), list(expected_loader))


@pytest.mark.timeout(30)
def test_batch_sampler_list_of_lists(remote: Any) -> None:
    batch_sampler = [[0, 1, 2], [5], [10, 3, 3, 102], [50, 49]]
    expected_loader = DataLoader(squares(), batch_sampler=batch_sampler)
    loader = remote("squares", batch_sampler=batch_sampler)
    assert len(loader) == len(expected_loader) == 4
    assert_same_batches(list(loader), list(expected_loader))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_objects(remote: Any, drop_last: bool) -> None:
    ds = squares()
    expected_loader = DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 10, drop_last))
    loader = remote("squares", batch_sampler=BatchSampler(SequentialSampler(range(SQUARES_N)), 10, drop_last))
    assert len(loader) == len(expected_loader) == (10 if drop_last else 11)
    assert_same_batches(list(loader), list(expected_loader))


@pytest.mark.timeout(30)
def test_distributed_sampler_two_epochs(remote: Any) -> None:
    def sampler() -> DistributedSampler:
        return DistributedSampler(range(SQUARES_N), num_replicas=3, rank=1, shuffle=True, seed=5)

    torch_sampler, remote_sampler = sampler(), sampler()
    expected_loader = DataLoader(squares(), batch_size=8, sampler=torch_sampler)
    loader = remote("squares", batch_size=8, sampler=remote_sampler)
    assert len(loader) == len(expected_loader) == 5
    epochs = []
    for epoch in range(2):
        torch_sampler.set_epoch(epoch)
        remote_sampler.set_epoch(epoch)
        got = list(loader)
        assert_same_batches(got, list(expected_loader))
        epochs.append(torch.cat([b[1] for b in got]).tolist())
    assert epochs[0] != epochs[1], "set_epoch did not change the order"


# ------------------------------------------------------------------ errors in the daemon


@pytest.mark.timeout(30)
def test_out_of_range_index_raises_dataset_index_error(remote: Any) -> None:
    expected_loader = DataLoader(squares(), batch_size=1, sampler=[0, 1, 500])
    loader = remote("squares", batch_size=1, sampler=[0, 1, 500])
    it = iter(loader)
    torch_it = iter(expected_loader)
    for i in range(2):
        assert_same(next(it), next(torch_it), f"batch {i}")
    with pytest.raises(IndexError, match="out of range"):
        next(torch_it)
    with pytest.raises(IndexError) as info:
        next(it)
    message = str(info.value)
    assert "Squares index 500 out of range for 103 items" in message
    assert "Traceback" in message and "__getitem__" in message, f"no remote traceback in: {message}"
    with pytest.raises(StopIteration):
        next(torch_it)
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.timeout(30)
def test_error_batch_then_next_batches_still_come(remote: Any) -> None:
    sampler = [4, 500, 0, 1, 2, 3, -200, 7, 8]
    expected_loader = DataLoader(squares(), batch_size=2, sampler=sampler)
    loader = remote("squares", batch_size=2, sampler=sampler)

    def drain(iterable: Any) -> list[Any]:
        out: list[Any] = []
        it = iter(iterable)
        while True:
            try:
                out.append(next(it))
            except StopIteration:
                return out
            except IndexError as exc:
                out.append(("IndexError", "out of range" in str(exc)))

    expected = drain(expected_loader)
    got = drain(loader)
    assert [type(x) for x in expected] == [tuple, list, list, tuple, list]
    assert_same_batches(got, expected)


# ------------------------------------------------------------------ collation


@pytest.mark.timeout(30)
@pytest.mark.parametrize("batch_size", [4, None])
def test_structured_default_collation(remote: Any, batch_size: int | None) -> None:
    expected_loader = DataLoader(datasets.Structured(), batch_size=batch_size)
    loader = remote("structured", batch_size=batch_size)
    assert len(loader) == len(expected_loader)
    got = list(loader)
    expected = list(expected_loader)
    # The oracle holds what the test means to cover.
    first = expected[0]
    assert isinstance(first["pair"], datasets.Pair)
    assert first["image"].dtype == torch.float16
    assert_same_batches(got, expected)


@pytest.mark.timeout(30)
def test_config_collate_fn_runs_in_daemon(remote: Any) -> None:
    expected_loader = DataLoader(squares(SUMMED_N), batch_size=6, collate_fn=datasets.sum_collate)
    loader = remote("summed", batch_size=6)
    assert len(loader) == len(expected_loader)
    got = list(loader)
    expected = list(expected_loader)
    assert len(got) == len(expected)
    for i, (r, t) in enumerate(zip(got, expected)):
        assert type(r) is dict and list(r) == list(t) == ["sum", "count", "pid"]
        assert_same(r["sum"], t["sum"], f"batch {i}['sum']")
        assert_same(r["count"], t["count"], f"batch {i}['count']")
        assert t["pid"] == os.getpid()
        assert type(r["pid"]) is int and r["pid"] != os.getpid(), "collate_fn did not run in the daemon"


# ------------------------------------------------------------------ random transforms


def _augment_epoch(
    address: str, transport: str, seed: int | None = None, generator_seed: int | None = None, **kw: Any
) -> list[Any]:
    if generator_seed is not None:
        kw["generator"] = torch.Generator().manual_seed(generator_seed)
    loader = RemoteDataLoader("augment", address=address, transport=transport, **kw)
    if seed is not None:
        torch.manual_seed(seed)
    return list(loader)


def _distinct_rows(t: torch.Tensor) -> int:
    return len({tuple(row) for row in t.reshape(t.shape[0], -1).tolist()})


@pytest.mark.timeout(60)
def test_random_transforms_seeded_per_loader_seed(
    daemon: RunningDaemon, daemon_one_worker: RunningDaemon, transport: str
) -> None:
    n = len(datasets.RandomAugment())
    first = _augment_epoch(daemon.address, transport, seed=31, batch_size=8)
    again = _augment_epoch(daemon.address, transport, seed=31, batch_size=8)
    assert_same_batches(again, first)

    # Indices follow torch; random values are not compared with torch (loaderd seeds per batch).
    expected_index = [b["index"] for b in DataLoader(datasets.RandomAugment(), batch_size=8)]
    assert_same_batches([b["index"] for b in first], expected_index)
    for i, batch in enumerate(first):
        assert list(batch) == ["index", "torch", "numpy", "random"]
        assert batch["torch"].dtype == torch.float32 and batch["torch"].shape == (8, 3)
        assert batch["numpy"].dtype == torch.float64 and batch["numpy"].shape == (8, 2)
        assert batch["random"].dtype == torch.float64 and batch["random"].shape == (8,)
        for key in ("torch", "numpy", "random"):
            assert _distinct_rows(batch[key]) == 8, f"batch {i}: items share {key} random values"
    for key in ("torch", "numpy", "random"):
        whole = torch.cat([b[key] for b in first])
        assert _distinct_rows(whole) == n, f"batches of one epoch share {key} random values"

    other = _augment_epoch(daemon.address, transport, seed=32, batch_size=8)
    for i, (a, b) in enumerate(zip(first, other)):
        for key in ("torch", "numpy", "random"):
            assert not torch.equal(a[key], b[key]), f"batch {i}: seeds 31 and 32 gave the same {key} values"

    # Same seed, whatever the pool size.
    one_worker = _augment_epoch(daemon_one_worker.address, transport, seed=31, batch_size=8)
    assert_same_batches(one_worker, first)


@pytest.mark.timeout(60)
def test_random_transforms_seeded_by_generator(
    daemon: RunningDaemon, daemon_one_worker: RunningDaemon, transport: str
) -> None:
    first = _augment_epoch(daemon.address, transport, generator_seed=8, batch_size=5, shuffle=True)
    # The global RNG has no say when a generator is given.
    torch.manual_seed(12345)
    again = _augment_epoch(daemon.address, transport, generator_seed=8, batch_size=5, shuffle=True)
    assert_same_batches(again, first)
    other = _augment_epoch(daemon.address, transport, generator_seed=9, batch_size=5, shuffle=True)
    assert not any(torch.equal(a["torch"], b["torch"]) for a, b in zip(first, other))
    one_worker = _augment_epoch(daemon_one_worker.address, transport, generator_seed=8, batch_size=5, shuffle=True)
    assert_same_batches(one_worker, first)
    # No automatic batching: per-item values still differ from item to item.
    items = _augment_epoch(daemon.address, transport, generator_seed=8, batch_size=None)
    assert _distinct_rows(torch.stack([item["torch"] for item in items])) == len(items)
    assert_same_batches(_augment_epoch(daemon_one_worker.address, transport, generator_seed=8, batch_size=None), items)


# ------------------------------------------------------------------ arguments and errors


def _local_fn(x: Any) -> Any:
    return x


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argument", ["collate_fn", "worker_init_fn"])
def test_code_arguments_belong_in_config(daemon: RunningDaemon, argument: str) -> None:
    with pytest.raises(loaderd.ConfigOnlyArgumentError) as info:
        RemoteDataLoader("squares", address=daemon.address, **{argument: _local_fn})
    assert isinstance(info.value, ValueError)
    assert "config" in str(info.value) and argument in str(info.value)


@pytest.mark.timeout(30)
def test_multiprocessing_context_refused(daemon: RunningDaemon) -> None:
    with pytest.raises(loaderd.ConfigOnlyArgumentError):
        RemoteDataLoader("squares", address=daemon.address, multiprocessing_context="fork")


@pytest.mark.timeout(30)
def test_unknown_dataset(daemon: RunningDaemon) -> None:
    with pytest.raises(loaderd.DatasetNotFoundError) as info:
        RemoteDataLoader("nope", address=daemon.address)
    message = str(info.value)
    assert "nope" in message
    for name in DATASETS:
        assert name in message, f"{name!r} not listed in: {message}"


# ------------------------------------------------------------------ epochs that end early, interleaving


@pytest.mark.timeout(30)
def test_break_early_then_new_epoch(remote: Any) -> None:
    expected_loader = DataLoader(squares(), batch_size=4, shuffle=True)
    loader = remote("squares", batch_size=4, shuffle=True)

    def run(dl: Any) -> list[list[Any]]:
        epochs = []
        for stop in (2, None, 0, None):
            taken = []
            for i, batch in enumerate(dl):
                if i == stop:
                    break
                taken.append(batch)
            epochs.append(taken)
        return epochs

    expected, rand_torch = rng_state_after(4, lambda: run(expected_loader))
    got, rand_remote = rng_state_after(4, lambda: run(loader))
    assert [len(e) for e in expected] == [2, 26, 0, 26]
    for epoch in range(4):
        assert_same_batches(got[epoch], expected[epoch])
    assert torch.equal(rand_remote, rand_torch)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("seeded", [True, False], ids=["generator", "global-rng"])
def test_stopping_before_the_last_batch_leaves_the_generators_as_torch_does(remote: Any, drop_last: bool, seeded: bool) -> None:
    """With a generator, a full last batch is planned with the rest (making it draws nothing) and a
    partial one, whose making ends the permutation and draws once more, only when asked for; without
    one, any last batch is planned with the rest (the sampler's own generator is private). Either way
    the generators end up where torch's (num_workers=0) do when the loop stops just before the last batch."""
    batch_size = 10
    assert SQUARES_N % batch_size  # so the last batch is full only with drop_last

    def run(make: Any) -> tuple[list[Any], list[torch.Tensor]]:
        torch.manual_seed(11)
        generator = torch.Generator().manual_seed(3) if seeded else None
        loader = make(generator)
        taken = []
        for i, batch in enumerate(loader):
            taken.append(batch)
            if i == len(loader) - 2:
                break
        return taken, [torch.get_rng_state()] + ([generator.get_state()] if generator is not None else [])

    expected, torch_states = run(lambda g: DataLoader(squares(), batch_size=batch_size, shuffle=True, drop_last=drop_last, generator=g))
    got, remote_states = run(lambda g: remote("squares", batch_size=batch_size, shuffle=True, drop_last=drop_last, generator=g))
    assert_same_batches(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(remote_states, torch_states, strict=True))


@pytest.mark.timeout(30)
def test_abandoned_iterator_then_new_epoch(remote: Any) -> None:
    loader = remote("squares", batch_size=7)
    it = iter(loader)
    assert_same(next(it), next(iter(DataLoader(squares(), batch_size=7))))
    # A fresh epoch while the old iterator is still referenced.
    assert_same_batches(list(loader), list(DataLoader(squares(), batch_size=7)))
    del it
    assert_same_batches(list(loader), list(DataLoader(squares(), batch_size=7)))


@pytest.mark.timeout(30)
def test_two_loaders_interleaved(remote: Any) -> None:
    g = [torch.Generator().manual_seed(21) for _ in range(2)]
    torch_a = DataLoader(squares(), batch_size=5, shuffle=True, generator=g[0])
    torch_b = DataLoader(datasets.Structured(), batch_size=3)
    remote_a = remote("squares", batch_size=5, shuffle=True, generator=g[1])
    remote_b = remote("structured", batch_size=3)
    expected = list(zip(torch_a, torch_b))
    got = list(zip(remote_a, remote_b))
    assert len(expected) == 14
    assert_same_batches(got, expected)
    # A next epoch of one of them, after the interleaved one ended early.
    expected_rest = list(torch_a)
    got_rest = list(remote_a)
    assert_same_batches(got_rest, expected_rest)


# ------------------------------------------------------------------ batches in shared-memory slots


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a (contiguous) tensor's data occupies in this process."""
    assert t.is_contiguous(), f"a batch tensor is not contiguous: {t.shape} {t.stride()}"
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _daemon_shm_mappings() -> list[tuple[int, int, str]]:
    """This process's mappings of the daemon's shared-memory segments (from /proc/self/maps)."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/dev/shm/loaderd-"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            found.append((start, end, parts[5]))
    return found


def _in_shared_memory(t: torch.Tensor, mappings: list[tuple[int, int, str]]) -> bool:
    lo, hi = _byte_range(t)
    return any(start <= lo and hi <= end for start, end, _ in mappings)


def _assert_no_aliasing(batches: list[Any]) -> None:
    """No two tensors of the held batches (of one batch or of two) share a byte."""
    ranges = sorted(
        (*_byte_range(t), f"batch {i} tensor {j}")
        for i, batch in enumerate(batches)
        for j, t in enumerate(tensors_of(batch))
        if t.numel()
    )
    for (_, end_a, what_a), (start_b, _, what_b) in itertools.pairwise(ranges):
        assert end_a <= start_b, f"{what_a} and {what_b} alias the same memory"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "batch_size", "shuffle"),
    [("squares-big", 6000, False), ("squares-big", 5120, True), ("structured-big", 512, False)],
    ids=["squares-tail-inline", "squares-shuffled", "structured"],
)
def test_large_batches_match_torch(remote: Any, name: str, batch_size: int, shuffle: bool) -> None:
    """Batches of 64 KiB and more: over shm they are slot views, over grpc chunked streams."""
    local = datasets.Squares(BIG_SQUARES_N) if name == "squares-big" else datasets.Structured(BIG_STRUCTURED_N)
    g_torch = torch.Generator().manual_seed(77)
    g_remote = torch.Generator().manual_seed(77)
    expected_loader = DataLoader(local, batch_size=batch_size, shuffle=shuffle, generator=g_torch)
    loader = remote(name, batch_size=batch_size, shuffle=shuffle, generator=g_remote)
    assert len(loader) == len(expected_loader)
    for epoch in range(2):
        got = list(loader)  # every batch of the epoch held at once
        expected = list(expected_loader)
        assert_same_batches(got, expected)
        _assert_no_aliasing(got)
        assert torch.equal(g_torch.get_state(), g_remote.get_state()), f"generator diverged in epoch {epoch}"


@pytest.mark.timeout(60)
def test_shm_batches_are_zero_copy_views_of_shared_memory(daemon: RunningDaemon) -> None:
    kw: dict[str, Any] = dict(batch_size=5120, address=daemon.address)
    expected = list(DataLoader(datasets.Squares(BIG_SQUARES_N), batch_size=5120))
    assert len(expected) == 4

    shm = list(RemoteDataLoader("squares-big", transport="shm", **kw))
    over_grpc = list(RemoteDataLoader("squares-big", transport="grpc", **kw))
    assert_same_batches(shm, expected)
    assert_same_batches(over_grpc, expected)
    assert_same_batches(shm, over_grpc)

    mappings = _daemon_shm_mappings()
    for i, batch in enumerate(shm):
        for j, t in enumerate(tensors_of(batch)):
            assert _in_shared_memory(t, mappings), f"shm batch {i} tensor {j} is not a view of the daemon's shared memory"
    for i, batch in enumerate(over_grpc):
        for j, t in enumerate(tensors_of(batch)):
            assert not _in_shared_memory(t, mappings), f"grpc batch {i} tensor {j} lies in the daemon's shared memory"
    _assert_no_aliasing(shm)

    # Held batches never change: later epochs get other slots while these are leased.
    loader = RemoteDataLoader("squares-big", transport="shm", **kw)
    for _ in range(2):
        later = list(loader)
        assert_same_batches(later, expected)
        _assert_no_aliasing(shm + later)
    assert_same_batches(shm, expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "batch_size"), [("squares-big", 5120), ("structured", 4)])
def test_auto_transport_equals_shm(daemon: RunningDaemon, name: str, batch_size: int) -> None:
    def epoch(transport: str) -> list[Any]:
        generator = torch.Generator().manual_seed(3)
        loader = RemoteDataLoader(
            name, batch_size=batch_size, shuffle=True, generator=generator, address=daemon.address, transport=transport
        )
        return list(loader)

    local = datasets.Squares(BIG_SQUARES_N) if name == "squares-big" else datasets.Structured()
    expected = list(DataLoader(local, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(3)))
    auto, shm = epoch("auto"), epoch("shm")
    assert_same_batches(auto, shm)
    assert_same_batches(auto, expected)
    if name == "squares-big":
        # The tests share the daemon's /dev/shm, so "auto" picked shared memory too.
        mappings = _daemon_shm_mappings()
        for i, batch in enumerate(auto):
            for j, t in enumerate(tensors_of(batch)):
                assert _in_shared_memory(t, mappings), f"auto batch {i} tensor {j} is not in shared memory"
