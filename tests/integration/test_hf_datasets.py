"""HuggingFace ``datasets`` served by the daemon, with torch's DataLoader over the same object as the oracle.

A config names a factory (``support.hf_datasets:table``, ``:stream``) that returns a ``Dataset`` in
torch format (map-style, with ``__getitems__``) or an ``IterableDataset`` of several shards, which
splits its shards between torch's workers by ``get_worker_info()``. RemoteDataLoader must yield what
torch yields: map-style with ``shuffle`` off and on (one seeded generator on either side), and
iterable with ``num_workers`` replicas that see the worker info torch's workers would.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support import hf_datasets
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, running_daemon
from torch.utils.data import DataLoader

from loaderd import RemoteDataLoader

N = 300
DATASETS: dict[str, Any] = {
    "hf-table": {"dataset": "support.hf_datasets:table", "kwargs": {"n": N}},
    "hf-stream": {"dataset": "support.hf_datasets:stream", "kwargs": {"n": N, "num_shards": 4}},
    "hf-shuffled": {"dataset": "support.hf_datasets:stream", "kwargs": {"n": N, "num_shards": 4, "shuffle_seed": 11}},
}
# A module's worth of torch workers (up to 8 per oracle) start from one fork server that has
# torch and datasets imported already: each then starts in milliseconds, not an import's seconds.
_CONTEXT = multiprocessing.get_context("forkserver")


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="ld-hf-", workers=2) as running:
        yield running


def oracle(dataset: Any, **kwargs: Any) -> DataLoader:
    if kwargs.get("num_workers", 0) > 0:
        _CONTEXT.set_forkserver_preload(["torch", "datasets", "support.hf_datasets"])
        kwargs["multiprocessing_context"] = _CONTEXT
    return DataLoader(dataset, **kwargs)


# torch's oracle warns of 8 workers on a small machine.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2, 8])
@pytest.mark.parametrize(("shuffle", "batch_size"), [(False, 32), (True, 7)])
def test_a_map_style_dataset_matches_torch(daemon: RunningDaemon, num_workers: int, shuffle: bool, batch_size: int) -> None:
    assert N % batch_size, "a partial last batch"
    expected_loader = oracle(
        hf_datasets.table(N), batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, generator=torch.Generator().manual_seed(5)
    )
    g_remote = torch.Generator().manual_seed(5)
    loader = RemoteDataLoader(
        "hf-table", batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, generator=g_remote, address=daemon.address
    )
    assert len(loader) == len(expected_loader)
    for epoch in range(2):
        expected = list(expected_loader)
        got = list(loader)
        assert_same_batches(got, expected, f"epoch {epoch}")
        assert torch.equal(g_remote.get_state(), expected_loader.generator.get_state()), "the generators were drawn differently"  # type: ignore[union-attr]
    ids = torch.cat([batch["id"] for batch in got])
    assert sorted(ids.tolist()) == list(range(N))
    assert (ids.tolist() != list(range(N))) == shuffle


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2, 8])
@pytest.mark.parametrize("name", ["hf-stream", "hf-shuffled"])
def test_an_iterable_dataset_matches_torch(daemon: RunningDaemon, transport: str, name: str, num_workers: int) -> None:
    batch_size = 16  # 300 rows in 4 shards of 75: every worker's last batch is partial
    expected = list(oracle(hf_datasets.stream(**DATASETS[name]["kwargs"]), batch_size=batch_size, num_workers=num_workers))
    got = list(RemoteDataLoader(name, batch_size=batch_size, num_workers=num_workers, address=daemon.address, transport=transport))
    assert_same_batches(got, expected)
    assert sorted(torch.cat([batch["id"] for batch in got]).tolist()) == list(range(N))
