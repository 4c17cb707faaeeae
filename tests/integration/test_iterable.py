"""IterableDataset semantics of RemoteDataLoader, with torch's own DataLoader as the oracle.

One daemon serves the whole module (starting one costs seconds); every test
builds the same dataset locally and compares what torch's DataLoader yields
with what the daemon streams, batch for batch.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from support import datasets
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, daemon_status, oracle_loader, running_daemon, wait_for
from torch.utils.data import DataLoader, SequentialSampler

from loaderd import RemoteDataLoader
from loaderd.stream.lane import client_name

# torch warns that 3 workers exceed a 2-core machine's suggestion; the oracle needs them anyway.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

STREAM_N = 50
ODD_N = 23
SIZED_N = 50
# 16 bytes a sample ({"x", "wid"} collate to two int64 tensors): batches of 5000
# are 80 KiB, over the daemon's 64 KiB inline threshold, so on the shm transport
# they travel through shared-memory slots (the small streams always go inline).
BIG_N = 12000
BIG_BATCH = 5000

DATASETS = {
    "stream": {"dataset": "support.datasets:Stream", "kwargs": {"n": STREAM_N}},
    "stream-odd": {"dataset": "support.datasets:Stream", "kwargs": {"n": ODD_N}},
    "uneven": {"dataset": "support.datasets:UnevenStream"},
    "sized": {"dataset": "support.datasets:SizedStream", "kwargs": {"n": SIZED_N}},
    "stream-big": {"dataset": "support.datasets:Stream", "kwargs": {"n": BIG_N}},
}

LOCAL = {
    "stream": lambda: datasets.Stream(STREAM_N),
    "stream-odd": lambda: datasets.Stream(ODD_N),
    "uneven": lambda: datasets.UnevenStream(),
    "sized": lambda: datasets.SizedStream(SIZED_N),
    "stream-big": lambda: datasets.Stream(BIG_N),
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    """One `loaderd serve` (2 pool workers) for every test of this module; checked at teardown."""
    with running_daemon(DATASETS, prefix="ld-it-") as running:
        yield running


# ------------------------------------------------------------------ helpers


def remote(daemon: RunningDaemon, transport: str, name: str, **kwargs: Any) -> RemoteDataLoader:
    return RemoteDataLoader(name, address=daemon.address, transport=transport, **kwargs)


def torch_batches(name: str, **kwargs: Any) -> list[Any]:
    return list(oracle_loader(LOCAL[name](), **kwargs))


def assert_refused_like_torch(daemon: RunningDaemon, transport: str, word: str, **kwargs: Any) -> None:
    """Over the "stream" dataset, torch's DataLoader and RemoteDataLoader refuse ``kwargs`` with the same ValueError."""
    with pytest.raises(ValueError) as torch_error:
        DataLoader(datasets.Stream(STREAM_N), batch_size=4, **kwargs)
    with pytest.raises(ValueError) as remote_error:
        remote(daemon, transport, "stream", batch_size=4, **kwargs)
    assert str(remote_error.value) == str(torch_error.value)
    assert word in str(remote_error.value)


def stream_samples(batches: list[Any], batched: bool) -> list[tuple[int, int]]:
    """(x, wid) of every sample in a list of Stream batches."""
    if not batched:
        return [(b["x"], b["wid"]) for b in batches]
    return [(int(x), int(w)) for b in batches for x, w in zip(b["x"], b["wid"])]


# ------------------------------------------------------------------ tests


@pytest.mark.timeout(90)
@pytest.mark.parametrize("batch_size", [4, None], ids=["batch4", "unbatched"])
def test_num_workers_0_is_one_replica_without_worker_info(
    daemon: RunningDaemon, transport: str, batch_size: int | None
) -> None:
    got = list(remote(daemon, transport, "stream", batch_size=batch_size, num_workers=0))
    want = torch_batches("stream", batch_size=batch_size, num_workers=0)
    assert_same_batches(got, want)
    samples = stream_samples(got, batched=batch_size is not None)
    # One replica saw the whole range, and get_worker_info() was None inside it.
    assert samples == [(i, -1) for i in range(STREAM_N)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize(
    ("batch_size", "drop_last"), [(4, False), (4, True), (None, False)], ids=["batch4", "batch4-drop_last", "unbatched"]
)
@pytest.mark.parametrize("name", ["stream", "stream-odd"])
def test_replicas_match_torch_workers(
    daemon: RunningDaemon, transport: str, name: str, num_workers: int, batch_size: int | None, drop_last: bool
) -> None:
    kwargs: dict[str, Any] = dict(batch_size=batch_size, drop_last=drop_last, num_workers=num_workers)
    got = list(remote(daemon, transport, name, **kwargs))
    want = torch_batches(name, **kwargs)
    batched = batch_size is not None
    got_samples, want_samples = stream_samples(got, batched), stream_samples(want, batched)
    # The same samples (each replica saw its own get_worker_info().id/num_workers) ...
    assert Counter(got_samples) == Counter(want_samples)
    assert {w for _, w in got_samples} == set(range(num_workers))
    # ... in torch's order: round-robin over the workers, batch for batch.
    assert_same_batches(got, want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("batch_size", "drop_last"),
    [(2, False), (2, True), (4, False), (None, False)],
    ids=["batch2", "batch2-drop_last", "batch4", "unbatched"],
)
def test_uneven_replicas_keep_torch_order(
    daemon: RunningDaemon, transport: str, batch_size: int | None, drop_last: bool
) -> None:
    """Replicas run dry at different times: torch skips spent workers in its round-robin."""
    kwargs: dict[str, Any] = dict(batch_size=batch_size, drop_last=drop_last, num_workers=3)
    got = list(remote(daemon, transport, "uneven", **kwargs))
    want = torch_batches("uneven", **kwargs)
    assert_same_batches(got, want)
    # Sanity of the oracle: all three workers contributed, the longest one last.
    flat = [tuple(t.tolist()) for b in want for t in (b if batch_size is not None else [b])]
    assert {w for w, _ in flat} == {0, 1, 2}
    assert flat[-1][0] == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("batch_size", "drop_last"),
    [(4, False), (4, True), (7, False), (7, True), (None, False), (50, True), (64, True)],
)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_len_of_sized_stream_matches_torch(
    daemon: RunningDaemon, transport: str, batch_size: int | None, drop_last: bool, num_workers: int
) -> None:
    kwargs: dict[str, Any] = dict(batch_size=batch_size, drop_last=drop_last, num_workers=num_workers)
    loader = remote(daemon, transport, "sized", **kwargs)
    oracle = DataLoader(datasets.SizedStream(SIZED_N), **kwargs)
    assert len(loader) == len(oracle)
    if batch_size is None:
        assert len(loader) == SIZED_N
    else:
        rounding = math.floor if drop_last else math.ceil
        assert len(loader) == rounding(SIZED_N / batch_size)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch_size", [4, None])
def test_len_of_unsized_stream_raises_type_error_like_torch(
    daemon: RunningDaemon, transport: str, batch_size: int | None
) -> None:
    oracle = DataLoader(datasets.Stream(STREAM_N), batch_size=batch_size)
    with pytest.raises(TypeError):
        len(oracle)
    loader = remote(daemon, transport, "stream", batch_size=batch_size, num_workers=2)
    with pytest.raises(TypeError):
        len(loader)
    # Still iterable in full after the failed len().
    assert_same_batches(list(loader), torch_batches("stream", batch_size=batch_size, num_workers=2))


@pytest.mark.timeout(60)
def test_shuffle_with_iterable_dataset_raises_value_error_like_torch(daemon: RunningDaemon, transport: str) -> None:
    assert_refused_like_torch(daemon, transport, "shuffle", shuffle=True)
    # shuffle=False is accepted by both.
    DataLoader(datasets.Stream(STREAM_N), batch_size=4, shuffle=False)
    assert_same_batches(
        list(remote(daemon, transport, "stream", batch_size=4, shuffle=False)), torch_batches("stream", batch_size=4)
    )


@pytest.mark.timeout(60)
def test_sampler_with_iterable_dataset_raises_value_error_like_torch(daemon: RunningDaemon, transport: str) -> None:
    assert_refused_like_torch(daemon, transport, "sampler", sampler=SequentialSampler(range(STREAM_N)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "num_workers"), [("stream", 2), ("uneven", 3), ("stream-odd", 0)])
def test_every_epoch_gives_the_full_data(daemon: RunningDaemon, transport: str, name: str, num_workers: int) -> None:
    loader = remote(daemon, transport, name, batch_size=4, num_workers=num_workers)
    want = torch_batches(name, batch_size=4, num_workers=num_workers)
    for epoch in range(3):
        got = list(loader)
        assert_same_batches(got, want, f"epoch {epoch}")
    # An epoch abandoned half-way does not leak into the next one.
    it = iter(loader)
    next(it)
    assert_same_batches(list(loader), want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_large_batches_match_torch_workers(daemon: RunningDaemon, transport: str, num_workers: int, drop_last: bool) -> None:
    """Batches over the inline threshold (shared-memory slots on shm), a small tail batch inline."""
    kwargs: dict[str, Any] = dict(batch_size=BIG_BATCH, drop_last=drop_last, num_workers=num_workers)
    loader = remote(daemon, transport, "stream-big", **kwargs)
    want = torch_batches("stream-big", **kwargs)
    assert any(len(b["x"]) == BIG_BATCH for b in want) and (drop_last or any(len(b["x"]) < BIG_BATCH for b in want))
    for epoch in range(2):
        got = list(loader)  # the whole epoch held at once
        assert_same_batches(got, want, f"epoch {epoch}")


@pytest.mark.timeout(60)
def test_status_counts_what_the_caller_took_between_credits(daemon: RunningDaemon, transport: str) -> None:
    """The client grants its credit every quarter window; the daemon's status still follows the caller
    batch by batch once it stops (CONSUMED, issue 38)."""
    kwargs: dict[str, Any] = dict(batch_size=1, num_workers=2)
    loader = remote(daemon, transport, "stream", prefetch_factor=8, **kwargs)  # a window of 16: a credit every 4 batches

    def consumed() -> int | None:
        mine = [s.consumed for s in daemon_status(daemon.address).streams if s.client == client_name() and s.dataset == "stream"]
        assert len(mine) <= 1, mine
        return mine[0] if mine else None

    it = iter(loader)
    got = []
    for taken in (3, 6):
        got += [next(it) for _ in range(taken - len(got))]
        wait_for(lambda: consumed() == taken, 20.0, f"CONSUMED to reach {taken}")
    got += list(it)
    assert_same_batches(got, torch_batches("stream", **kwargs))
