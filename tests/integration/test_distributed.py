"""Options that coordinate several training processes: DDP ranks, and shared jobs (client side).

``RemoteDataLoader(name, rank=r, world_size=w, ...)`` must yield what
``DataLoader(ds, batch_size=b, drop_last=d, sampler=DistributedSampler(ds,
num_replicas=w, rank=r, shuffle=s, seed=seed, drop_last=d))`` yields, epoch by
epoch with ``set_epoch``, with the real dataset as torch's oracle.
``share="name"`` makes loaders agree on their randomness and join one job.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support import datasets
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, running_daemon
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

import loaderd
from loaderd import RemoteDataLoader
from loaderd.loader.identity import share_seed

SIZES = (103, 10, 12)
DATASETS: dict[str, Any] = {
    **{f"squares-{n}": {"dataset": "support.datasets:Squares", "kwargs": {"n": n}} for n in SIZES},
    "augment": {"dataset": "support.datasets:RandomAugment", "kwargs": {"n": 30}},
    "stream": {"dataset": "support.datasets:Stream", "kwargs": {"n": 20}},
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="ld-dd-", workers=2) as running:
        yield running


def torch_ddp(n: int, world_size: int, rank: int, *, batch_size: int | None, shuffle: bool, drop_last: bool, seed: int) -> DataLoader:
    """The definition: torch's DataLoader over the real dataset with a DistributedSampler."""
    ds = datasets.Squares(n)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(ds, batch_size=batch_size, sampler=sampler, drop_last=drop_last)


def indices(batches: list[Any], batched: bool = True) -> list[int]:
    if not batched:
        return [item[1] for item in batches]
    return [i for batch in batches for i in batch[1].tolist()]


# ------------------------------------------------------------------ ranks


RANK_CASES = [
    # (world_size, rank, shuffle, drop_last, batch_size, n); 103 and 10 need padding for most world sizes
    (2, 0, True, False, 8, 103),
    (3, 2, True, True, 5, 103),
    (4, 1, False, False, 3, 10),
    (4, 3, False, True, 1, 10),
    (3, 1, True, False, 4, 10),
    (1, 0, True, False, 7, 103),
    (5, 4, True, False, None, 12),
    (4, 2, True, True, 2, 12),  # divisible: no padding, nothing dropped
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world_size", "rank", "shuffle", "drop_last", "batch_size", "n"), RANK_CASES)
def test_rank_matches_torch_distributed_sampler(
    daemon: RunningDaemon, transport: str, world_size: int, rank: int, shuffle: bool, drop_last: bool, batch_size: int | None, n: int
) -> None:
    seed = 17
    expected_loader = torch_ddp(n, world_size, rank, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed)
    loader = RemoteDataLoader(
        f"squares-{n}",
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        rank=rank,
        world_size=world_size,
        seed=seed,
        address=daemon.address,
        transport=transport,
    )
    assert len(loader) == len(expected_loader)
    assert isinstance(loader.sampler, DistributedSampler)
    orders = []
    for epoch in range(2):
        expected_loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        loader.set_epoch(epoch)
        # The base seed comes from the global RNG in both: consumed alike.
        torch.manual_seed(epoch)
        expected = list(expected_loader)
        after_torch = torch.rand(1)
        torch.manual_seed(epoch)
        got = list(loader)
        after_remote = torch.rand(1)
        assert_same_batches(got, expected, f"epoch {epoch}")
        assert torch.equal(after_torch, after_remote)
        orders.append(indices(got, batch_size is not None))
    if shuffle and len(orders[0]) > 1:
        assert orders[0] != orders[1], "set_epoch did not reshuffle"


@pytest.mark.timeout(60)
def test_rank_with_generator_draws_base_seed_from_it(daemon: RunningDaemon) -> None:
    ds = datasets.Squares(103)
    sampler = DistributedSampler(ds, num_replicas=3, rank=0, seed=2)
    expected_loader = DataLoader(ds, batch_size=6, sampler=sampler, generator=torch.Generator().manual_seed(9))
    g_remote = torch.Generator().manual_seed(9)
    loader = RemoteDataLoader("squares-103", batch_size=6, rank=0, world_size=3, seed=2, generator=g_remote, address=daemon.address)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        loader.set_epoch(epoch)
        assert_same_batches(list(loader), list(expected_loader))
        assert torch.equal(expected_loader.generator.get_state(), g_remote.get_state())  # type: ignore[union-attr]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world_size", "shuffle", "drop_last", "n"), [(3, True, False, 103), (4, False, False, 10), (4, True, True, 10)])
def test_ranks_together_cover_the_dataset_as_torch_does(
    daemon: RunningDaemon, world_size: int, shuffle: bool, drop_last: bool, n: int
) -> None:
    got: Counter[int] = Counter()
    expected: Counter[int] = Counter()
    for rank in range(world_size):
        kw: dict[str, Any] = dict(batch_size=2, shuffle=shuffle, drop_last=drop_last, seed=3)
        loader = RemoteDataLoader(f"squares-{n}", rank=rank, world_size=world_size, address=daemon.address, **kw)
        loader.set_epoch(1)
        got.update(indices(list(loader)))
        oracle = torch_ddp(n, world_size, rank, **kw)
        oracle.sampler.set_epoch(1)  # type: ignore[attr-defined]
        expected.update(indices(list(oracle)))
    assert got == expected
    if drop_last:
        assert sum(got.values()) == (n // world_size) * world_size and max(got.values()) == 1
    else:
        # Every index at least once; padding repeats the first few to even out the ranks.
        assert set(got) == set(range(n)) and sum(got.values()) == -(-n // world_size) * world_size


@pytest.mark.timeout(60)
def test_set_epoch_reaches_a_user_distributed_sampler(daemon: RunningDaemon) -> None:
    torch_sampler = DistributedSampler(range(103), num_replicas=3, rank=1, seed=5)
    remote_sampler = DistributedSampler(range(103), num_replicas=3, rank=1, seed=5)
    expected_loader = DataLoader(datasets.Squares(103), batch_size=8, sampler=torch_sampler)
    loader = RemoteDataLoader("squares-103", batch_size=8, sampler=remote_sampler, address=daemon.address)
    for epoch in (0, 3):
        torch_sampler.set_epoch(epoch)
        loader.set_epoch(epoch)
        assert remote_sampler.epoch == epoch
        assert_same_batches(list(loader), list(expected_loader))


@pytest.mark.timeout(60)
def test_epoch_counter(daemon: RunningDaemon) -> None:
    loader = RemoteDataLoader("squares-10", batch_size=4, address=daemon.address)
    assert loader.epoch == 0
    list(loader)
    assert loader.epoch == 1
    loader.set_epoch(5)
    assert loader.epoch == 5
    iter(loader)  # the epoch is numbered when it starts
    assert loader.epoch == 6


@pytest.mark.timeout(60)
def test_rank_argument_errors(daemon: RunningDaemon) -> None:
    def refused(*words: str, name: str = "squares-10", **kw: Any) -> None:
        with pytest.raises(ValueError) as info:
            RemoteDataLoader(name, batch_size=2, address=daemon.address, **kw)
        for word in words:
            assert word in str(info.value), f"{word!r} not in: {info.value}"

    refused("rank and world_size go together", rank=0)
    refused("rank and world_size go together", world_size=2)
    refused("rank must be an int in [0, world_size=2)", rank=2, world_size=2)
    refused("rank must be", rank=-1, world_size=2)
    refused("rank must be", rank="0", world_size=2)
    refused("rank must be", rank=True, world_size=2)
    refused("world_size must be a positive int", rank=0, world_size=0)
    refused("world_size must be a positive int", rank=0, world_size=2.0)
    refused("cannot go with sampler=", rank=0, world_size=2, sampler=SequentialSampler(range(10)))
    refused("cannot go with batch_sampler=", rank=0, world_size=2, batch_sampler=BatchSampler(range(10), 2, False))
    refused("IterableDataset", name="stream", rank=0, world_size=2)
    refused("seed=", seed=3)
    refused("seed must be an int", rank=0, world_size=2, seed="3")
    loader = RemoteDataLoader("squares-10", rank=0, world_size=2, address=daemon.address)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="epoch must be a non-negative int"):
            loader.set_epoch(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ shares (client side)


@pytest.mark.timeout(60)
def test_share_loaders_agree_epoch_after_epoch(daemon: RunningDaemon) -> None:
    """Two loaders of a share, one numbering epochs with set_epoch and one not: the same batches, random values included."""
    kw: dict[str, Any] = dict(batch_size=4, shuffle=True, share="agree", seed=3, address=daemon.address)
    counted = RemoteDataLoader("augment", **kw)
    numbered = RemoteDataLoader("augment", **kw)
    orders = []
    for epoch in range(2):
        numbered.set_epoch(epoch)
        pairs = list(zip(counted, numbered))
        assert len(pairs) == len(counted) == 8
        assert_same_batches([b for b, _ in pairs], [b for _, b in pairs], f"epoch {epoch}")
        order = [i for b, _ in pairs for i in b["index"].tolist()]
        # The shuffle is torch's RandomSampler seeded from (share, seed, epoch).
        oracle = DataLoader(range(30), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(share_seed("agree", 3, epoch)))
        assert order == [i for b in oracle for i in b.tolist()]
        orders.append(order)
    assert orders[0] != orders[1], "the share did not reshuffle between epochs"


@pytest.mark.timeout(30)
def test_share_seed_is_stable() -> None:
    # Pinned: loaders of one share in different processes, hosts and versions must agree.
    assert share_seed("agree", 3, 0) == share_seed("agree", 3, 0) < 2**63
    assert len({share_seed("a", 0, 0), share_seed("a", 0, 1), share_seed("a", 1, 0), share_seed("b", 0, 0)}) == 4
    assert share_seed("digits", 0, 0) == 4926530237530387025


@pytest.mark.timeout(60)
def test_share_mismatch_reaches_the_user(daemon: RunningDaemon) -> None:
    first = RemoteDataLoader("augment", batch_size=4, shuffle=True, share="strict", address=daemon.address)
    running = iter(first)
    next(running)  # the job is open while this epoch runs
    other = RemoteDataLoader("augment", batch_size=5, shuffle=True, share="strict", address=daemon.address)
    with pytest.raises(loaderd.InvalidRequestError) as info:
        next(iter(other))
    message = str(info.value)
    assert "share 'strict'" in message and "batch_size=4" in message and "batch_size=5" in message
    assert len(list(running)) == 7  # the share itself carries on


@pytest.mark.timeout(60)
def test_share_per_rank_jobs(daemon: RunningDaemon) -> None:
    """Ranks plan different indices: each rank of a share joins its own job."""
    kw: dict[str, Any] = dict(batch_size=3, world_size=2, share="ddp", seed=1, address=daemon.address)
    rank0, rank1 = (RemoteDataLoader("squares-103", rank=r, **kw) for r in range(2))
    pairs = list(zip(rank0, rank1))
    for rank, got in enumerate(zip(*pairs)):
        expected = torch_ddp(103, 2, rank, batch_size=3, shuffle=True, drop_last=False, seed=1)
        assert_same_batches(list(got), list(expected), f"rank {rank}")


@pytest.mark.timeout(60)
def test_share_argument_errors(daemon: RunningDaemon) -> None:
    with pytest.raises(ValueError, match="share= and generator= cannot go together"):
        RemoteDataLoader("augment", share="s", generator=torch.Generator(), address=daemon.address)
    with pytest.raises(ValueError, match="share= serves map-style datasets; 'stream' is an IterableDataset"):
        RemoteDataLoader("stream", batch_size=2, share="s", address=daemon.address)
    with pytest.raises(ValueError, match="non-empty string"):
        RemoteDataLoader("augment", share="", address=daemon.address)


_DDP_RANK = r"""
import sys, warnings
import torch.distributed as dist
from loaderd import RemoteDataLoader
rank, store, address = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if rank == 1:
    import accelerate  # a framework in use: the warning names its adapter
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    plain = RemoteDataLoader("squares-10", batch_size=4, address=address)
    sharded = RemoteDataLoader("squares-10", batch_size=4, address=address, rank=rank, world_size=2)
    for loader in (plain, plain, sharded, sharded):  # two epochs each
        list(loader)
said = [str(w.message) for w in caught if "torch.distributed group" in str(w.message)]
print(len(said), said[0] if said else "")
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_a_loader_without_a_shard_under_ddp_warns_once_naming_rank_and_world_size(daemon: RunningDaemon, tmp_path: Path) -> None:
    """Every rank would get the whole epoch in the same order; the loader says so once, with the arguments to
    pass, and the adapter of the framework it sees (rank 1 imported accelerate)."""
    store = tmp_path / "store"
    ranks = [
        subprocess.Popen([sys.executable, "-c", _DDP_RANK, str(rank), str(store), daemon.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=100) for rank in ranks]
    for rank, (out, err) in enumerate(outputs):
        assert ranks[rank].returncode == 0, err
        count, _, message = out.strip().partition(" ")
        assert count == "1", out
        assert "RemoteDataLoader('squares-10') is iterated in a torch.distributed group of 2 processes" in message, message
        if rank == 0:
            assert f"Pass rank={rank}, world_size=2" in message, message
        else:
            assert "Under accelerate, prepare it with loaderd.integrations.accelerate.prepare_loader(accelerator, loader)" in message, message
            assert f"or pass rank={rank}, world_size=2" in message, message
