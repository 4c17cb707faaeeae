"""IterableDataset semantics of RemoteDataLoader, with torch's own DataLoader as the oracle.

One daemon serves the whole module (starting one costs seconds); every test
builds the same dataset locally and compares what torch's DataLoader yields
with what the daemon streams, batch for batch.
"""

from __future__ import annotations

import math
import multiprocessing
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from conftest import STARTUP_TIMEOUT_S, RunningDaemon, serve_command, wait_serving, write_config
from torch.utils.data import DataLoader, SequentialSampler

from loaderd import RemoteDataLoader

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
    "stream": {"dataset": "datasets:Stream", "kwargs": {"n": STREAM_N}},
    "stream-odd": {"dataset": "datasets:Stream", "kwargs": {"n": ODD_N}},
    "uneven": {"dataset": "datasets:UnevenStream"},
    "sized": {"dataset": "datasets:SizedStream", "kwargs": {"n": SIZED_N}},
    "stream-big": {"dataset": "datasets:Stream", "kwargs": {"n": BIG_N}},
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
    tmp = Path(tempfile.mkdtemp(prefix="ld-it-", dir="/tmp"))
    socket_path = tmp / "d.sock"
    config_path = write_config(tmp, DATASETS, workers=2, listen=[f"unix://{socket_path}"])
    log_path = tmp / "daemon.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(serve_command(config_path), stdout=log_file, stderr=subprocess.STDOUT, text=True)
    running = RunningDaemon(process, f"unix://{socket_path}", socket_path, config_path, log_path)
    try:
        wait_serving(running.address, process, log_path, STARTUP_TIMEOUT_S)
        yield running
        assert process.poll() is None, f"daemon died during the tests ({process.returncode}):\n{running.log()}"
        code = running.stop()
        assert code == 0, f"daemon exited with {code}:\n{running.log()}"
        assert not socket_path.exists(), "daemon left its socket file behind"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(params=["shm", "grpc"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every test runs over both transports, against the same module daemon."""
    return request.param


# ------------------------------------------------------------------ helpers


def assert_same(got: Any, want: Any, path: str = "batch") -> None:
    """Exact structural equality: same types, same tensor dtypes, shapes and values."""
    assert type(got) is type(want), f"{path}: type {type(got).__name__} != {type(want).__name__} ({got!r} vs {want!r})"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want), f"{path}: {got} != {want}"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def assert_same_batches(got: list[Any], want: list[Any], label: str = "") -> None:
    assert len(got) == len(want), f"{label}{len(got)} batches, torch gives {len(want)}:\n got {got}\nwant {want}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"{label}batch {i}")


def oracle_loader(dataset: Any, **kwargs: Any) -> DataLoader:
    """torch's DataLoader as the oracle. Its worker processes come from a fork server:
    forking this process, which runs gRPC threads, can deadlock the forked worker."""
    if kwargs.get("num_workers", 0) > 0:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "datasets"])  # workers start in milliseconds, not seconds
        kwargs["multiprocessing_context"] = context
    return DataLoader(dataset, **kwargs)


def remote(daemon: RunningDaemon, transport: str, name: str, **kwargs: Any) -> RemoteDataLoader:
    return RemoteDataLoader(name, address=daemon.address, transport=transport, **kwargs)


def torch_batches(name: str, **kwargs: Any) -> list[Any]:
    return list(oracle_loader(LOCAL[name](), **kwargs))


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
    with pytest.raises(ValueError) as torch_error:
        DataLoader(datasets.Stream(STREAM_N), batch_size=4, shuffle=True)
    with pytest.raises(ValueError) as remote_error:
        remote(daemon, transport, "stream", batch_size=4, shuffle=True)
    assert str(remote_error.value) == str(torch_error.value)
    assert "shuffle" in str(remote_error.value)
    # shuffle=False is accepted by both.
    DataLoader(datasets.Stream(STREAM_N), batch_size=4, shuffle=False)
    assert_same_batches(
        list(remote(daemon, transport, "stream", batch_size=4, shuffle=False)), torch_batches("stream", batch_size=4)
    )


@pytest.mark.timeout(60)
def test_sampler_with_iterable_dataset_raises_value_error_like_torch(daemon: RunningDaemon, transport: str) -> None:
    sampler = SequentialSampler(range(STREAM_N))
    with pytest.raises(ValueError) as torch_error:
        DataLoader(datasets.Stream(STREAM_N), batch_size=4, sampler=sampler)
    with pytest.raises(ValueError) as remote_error:
        remote(daemon, transport, "stream", batch_size=4, sampler=sampler)
    assert str(remote_error.value) == str(torch_error.value)
    assert "sampler" in str(remote_error.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "num_workers"), [("stream", 2), ("uneven", 3), ("stream-odd", 0)])
def test_every_epoch_gives_the_full_data(daemon: RunningDaemon, transport: str, name: str, num_workers: int) -> None:
    loader = remote(daemon, transport, name, batch_size=4, num_workers=num_workers)
    want = torch_batches(name, batch_size=4, num_workers=num_workers)
    for epoch in range(3):
        got = list(loader)
        assert_same_batches(got, want, f"epoch {epoch}: ")
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
        assert_same_batches(got, want, f"epoch {epoch}: ")
