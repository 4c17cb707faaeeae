"""A dataset's ``threads:`` on a real daemon: a worker fetches a batch's items side by side, and the loader
yields what torch's DataLoader yields (batches, order, errors)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
import torch
from support import datasets
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, oracle_loader, running_daemon
from torch.utils.data import DataLoader

from loaderd import RemoteDataLoader

pytestmark = pytest.mark.timeout(90)

BIG_N = 20480  # 16 bytes a sample: full batches of 5120 travel in a shared-memory slot

DATASETS = {
    "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 103}, "threads": 4},
    "squares-big": {"dataset": "support.datasets:Squares", "kwargs": {"n": BIG_N}, "threads": 3},
    "batch-fetch": {"dataset": "support.datasets:BatchFetch", "kwargs": {"n": 60}, "threads": 2, "transform": "support.datasets:double_first"},
    # Each item waits for a second one at a barrier: only side-by-side items get through.
    "rendezvous": {"dataset": "support.datasets:Rendezvous", "kwargs": {"n": 48, "parties": 2}, "threads": 2},
    "failing": {"dataset": "support.datasets:Failing", "kwargs": {"n": 30, "bad": [17, 11]}, "threads": 3},
    # An iterable dataset: its iterator runs on the worker's thread, its transform across the threads.
    "stream": {"dataset": "support.datasets:Stream", "kwargs": {"n": 50}, "transform": "support.datasets:square_x"},
    # Items that wait 4 ms (storage): threads: auto doubles a worker's threads while that pays (server/worker/thread_sizer.py).
    "waits": {"dataset": "support.datasets:Slow", "kwargs": {"n": 2048, "delay": 0.004}, "threads": "auto"},
    "stream-threads": {"dataset": "support.datasets:Stream", "kwargs": {"n": 50}, "transform": "support.datasets:square_x", "threads": 3},
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="ld-thr-", workers=2) as running:
        yield running


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_threaded_items_give_torch_s_batches_in_order(daemon: RunningDaemon, transport: str) -> None:
    kw = {"batch_size": 8, "shuffle": True, "drop_last": False}
    got = list(RemoteDataLoader("squares", address=daemon.address, transport=transport, generator=torch.Generator().manual_seed(3), **kw))
    want = list(oracle_loader(datasets.Squares(103), generator=torch.Generator().manual_seed(3), **kw))
    assert_same_batches(got, want, "squares, threads: 4")
    big = list(RemoteDataLoader("squares-big", address=daemon.address, transport=transport, batch_size=5120))
    assert_same_batches(big, list(DataLoader(datasets.Squares(BIG_N), batch_size=5120)), "squares-big, threads: 3")


def test_getitems_and_transform_run_across_the_threads(daemon: RunningDaemon) -> None:
    got = list(RemoteDataLoader("batch-fetch", address=daemon.address, batch_size=10))
    want = [(t * 2, i) for t, i in (datasets.Squares(60)[j] for j in range(60))]
    assert_same_batches(got, list(DataLoader(want, batch_size=10)), "batch-fetch")


def test_items_of_one_batch_run_side_by_side(daemon: RunningDaemon) -> None:
    got = list(RemoteDataLoader("rendezvous", address=daemon.address, batch_size=6))
    assert torch.cat(got).tolist() == list(range(48))


def test_an_item_s_error_reaches_the_client_as_torch_raises_it_and_the_loader_goes_on(daemon: RunningDaemon) -> None:
    outcomes: list[object] = []
    it = iter(RemoteDataLoader("failing", address=daemon.address, batch_size=10))
    for _ in range(3):
        try:
            outcomes.append(next(it).tolist())
        except ValueError as exc:
            outcomes.append(str(exc))
    with pytest.raises(StopIteration):
        next(it)
    assert outcomes[0] == list(range(10))
    assert "bad item 11" in str(outcomes[1])  # the batch's first failing item, as one thread would fail
    assert outcomes[2] == list(range(20, 30))


def test_an_iterable_dataset_s_transform_across_threads_changes_nothing(daemon: RunningDaemon) -> None:
    kw = {"address": daemon.address, "batch_size": 4, "num_workers": 2}
    serial = list(RemoteDataLoader("stream", **kw))
    threaded = list(RemoteDataLoader("stream-threads", **kw))
    assert_same_batches(threaded, serial, "stream, threads: 3")
    assert sorted(x for batch in threaded for x in batch["x"].tolist()) == [i * i for i in range(50)]


def test_threads_auto_climbs_for_items_that_wait_and_changes_no_batch(daemon: RunningDaemon) -> None:
    kw = {"batch_size": 16, "shuffle": True}
    want = list(oracle_loader(datasets.Slow(2048, delay=0.0), generator=torch.Generator().manual_seed(5), **kw))
    climbed = re.compile(r"dataset 'waits' now runs (4|8|16|32) item threads")
    deadline = time.monotonic() + 60
    epochs = 0
    while not climbed.search(daemon.log()):
        assert time.monotonic() < deadline, f"no worker climbed to 4 threads:\n{daemon.log()}"
        loader = RemoteDataLoader("waits", address=daemon.address, generator=torch.Generator().manual_seed(5), **kw)
        assert_same_batches(list(loader), want, f"waits, threads: auto, loader {epochs}")
        epochs += 1
    assert epochs >= 1  # the climb came from these epochs, and each was compared with torch's
