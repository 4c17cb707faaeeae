"""The item cache (``cache:``) and ``transform:`` against torch's DataLoader over the real dataset.

With a cache, every epoch yields exactly what it yields without one: the deterministic part of
each item is torch's, and the random part (``transform``, run after the cache under the batch's
seeds) is the uncached daemon's, for 1 and 4 workers, ranks, shares and resumes. Each item is
computed once per daemon (the dataset logs its calls); a disk cache survives a restart, a
SIGKILL mid-fill and a second daemon writing beside it; a changed spec reads nothing of the
old one; a cache smaller than the dataset keeps a stable subset.
"""

from __future__ import annotations

import glob
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.cached_datasets import Cheap, Counted, Transformed, computed
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, daemon_status, loaderd_cli, metrics_url, running_daemon, scrape
from torch.utils.data import DataLoader, DistributedSampler

from loaderd import RemoteDataLoader
from loaderd.loader.identity import share_seed
from loaderd.wire.limits import SEGMENT_PREFIX, SHM_DIR

N = 40
DETERMINISTIC = ("clean", "label", "index")
# auto-off's items: a slice of a tensor made once (microseconds) that takes ~0.1 ms to read back: far from the line.
CHEAP_BYTES = 256 << 10


def _spec(log: Path, cache: dict[str, Any] | str | None, factory: str = "Counted", **kwargs: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "dataset": f"support.cached_datasets:{factory}",
        "kwargs": {"n": N, "log": str(log), **kwargs},
        "transform": "support.cached_datasets:augment",
    }
    if cache is not None:
        spec["cache"] = cache
    return spec


def _epochs(loader: RemoteDataLoader, epochs: int = 3) -> list[list[Any]]:
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        torch.manual_seed(100 + epoch)  # the base seed is drawn from the global RNG, as torch's is
        out.append(list(loader))
    return out


def _part(batches: list[Any], keys: tuple[str, ...] = DETERMINISTIC) -> list[dict[str, Any]]:
    return [{k: b[k] for k in keys} for b in batches]


def _torch_epochs(n: int = N, epochs: int = 3, rank: int | None = None, world_size: int | None = None, **kw: Any) -> list[list[Any]]:
    ds = Transformed(Counted(n, os.devnull))
    out = []
    for epoch in range(epochs):
        if rank is not None:
            sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            loader = DataLoader(ds, batch_size=kw["batch_size"], sampler=sampler)
        else:
            loader = DataLoader(ds, generator=torch.Generator().manual_seed(epoch), **kw)
        torch.manual_seed(100 + epoch)
        out.append(list(loader))
    return out


def _our_shm() -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}*items-*"))


@pytest.fixture(scope="module", params=[1, 4], ids=["1-worker", "4-workers"])
def cached(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, Path]]:
    """A daemon with the same dataset plain and with a memory cache; the dataset's call log."""
    logs = tmp_path_factory.mktemp("logs")
    datasets = {
        "plain": _spec(logs / "plain", None),
        "mem": _spec(logs / "mem", {"memory": "8MiB"}),
        # cache: auto over items that cost 2 ms of CPU each (it pays), and over slices of a tensor (it does not).
        "auto-on": _spec(logs / "auto-on", "auto", cpu_ms=2.0),
        "auto-off": _spec(logs / "auto-off", {"memory": "32MiB", "auto": True}, factory="Cheap", image_bytes=CHEAP_BYTES),
    }
    before = set(_our_shm())
    with running_daemon(datasets, prefix="ld-ic-", workers=request.param, metrics={"port": 0}) as daemon:
        yield daemon, logs
        # Each memory tier is one LMDB file and its lock file; auto-off's went if it decided off (a test ran it).
        modes = {d.info.name: d.cache.mode for d in daemon_status(daemon.address).datasets if d.HasField("cache")}
        assert len(set(_our_shm()) - before) == (4 if modes["auto-off"] == "off" else 6), modes
    assert set(_our_shm()) <= before, "the memory tier outlived its daemon"


@pytest.mark.timeout(60)
def test_cache_on_equals_off_equals_torch(cached: tuple[RunningDaemon, Path]) -> None:
    daemon, logs = cached
    kw: dict[str, Any] = dict(batch_size=6, shuffle=True, address=daemon.address)
    got = {name: _epochs(RemoteDataLoader(name, generator=torch.Generator().manual_seed(0), **kw)) for name in ("plain", "mem")}
    # generator seeds the shuffle per epoch the way the oracle's fresh generators do
    for epoch, (off, on) in enumerate(zip(got["plain"], got["mem"])):
        assert_same_batches(on, off, f"epoch {epoch}: cache on vs off")
    # Every index computed once by the cached daemon, whatever the epochs and workers; every epoch by the plain one.
    assert computed(logs / "mem") == {i: 1 for i in range(N)}
    assert computed(logs / "plain") == {i: 3 for i in range(N)}
    # Status counts the cache as the workers saw it: N misses, 2N hits, N items stored; none for the plain one.
    by_name = {d.info.name: d for d in daemon_status(daemon.address).datasets}
    cache = by_name["mem"].cache
    assert (cache.tier, cache.items, cache.misses, cache.hits, cache.capacity_bytes) == ("memory", N, N, 2 * N, 8 << 20)
    assert 0 < cache.used_bytes <= cache.capacity_bytes and cache.saved_cpu_s > 0
    assert not by_name["plain"].HasField("cache")
    table = loaderd_cli("status", "--address", daemon.address).stdout
    assert "CACHE" in table and "67%" in table, table  # hit rate 2N / 3N
    samples = scrape(metrics_url(daemon.log()))
    labels = frozenset({"dataset": "mem", "tier": "memory"}.items())
    assert (samples[("loaderd_cache_hits_total", labels)], samples[("loaderd_cache_items", labels)]) == (2 * N, N)
    # Epochs differ (the transform's seeds and the shuffle), and the deterministic part is torch's.
    assert not torch.equal(got["mem"][0][0]["image"], got["mem"][1][0]["image"])
    oracle = DataLoader(Transformed(Counted(N, os.devnull)), batch_size=6)
    assert_same_batches(_part(list(RemoteDataLoader("mem", batch_size=6, address=daemon.address))), _part(list(oracle)))


@pytest.mark.timeout(60)
def test_cache_with_ranks_shares_and_resume(cached: tuple[RunningDaemon, Path]) -> None:
    daemon, _ = cached
    # Ranks: the deterministic part is torch's DistributedSampler's, the rest the uncached daemon's.
    for rank in range(2):
        kw: dict[str, Any] = dict(batch_size=4, shuffle=True, rank=rank, world_size=2, seed=0, address=daemon.address)
        on, off = _epochs(RemoteDataLoader("mem", **kw), 2), _epochs(RemoteDataLoader("plain", **kw), 2)
        want = _torch_epochs(epochs=2, rank=rank, world_size=2, batch_size=4)
        for epoch in range(2):
            assert_same_batches(on[epoch], off[epoch], f"rank {rank} epoch {epoch}")
            assert_same_batches(_part(on[epoch]), _part(want[epoch]), f"rank {rank} epoch {epoch} vs torch")
    # Shares: two loaders of one share agree, in the share's own order (torch's RandomSampler seeded from it).
    loaders = [RemoteDataLoader("mem", batch_size=5, shuffle=True, share="cached", seed=4, address=daemon.address) for _ in range(2)]
    pairs = list(zip(*loaders))
    assert_same_batches([a for a, _ in pairs], [b for _, b in pairs], "share members")
    order = DataLoader(range(N), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(share_seed("cached", 4, 0)))
    assert [i for a, _ in pairs for i in a["index"].tolist()] == [i for b in order for i in b.tolist()]
    # A mid-epoch resume yields the rest of the uninterrupted epoch.
    whole = RemoteDataLoader("mem", batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(9), address=daemon.address)
    expected = list(whole)
    first = RemoteDataLoader("mem", batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(9), address=daemon.address)
    for i, _ in enumerate(first):
        if i == 2:
            break
    resumed = RemoteDataLoader("mem", batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(9), address=daemon.address)
    resumed.load_state_dict(first.state_dict())
    assert_same_batches(list(resumed), expected[3:], "resumed")


@pytest.mark.timeout(60)
def test_cache_auto_decides_in_the_first_epoch_and_says_why(cached: tuple[RunningDaemon, Path]) -> None:
    daemon, logs = cached
    kw: dict[str, Any] = dict(batch_size=6, shuffle=True, address=daemon.address)
    plain = _epochs(RemoteDataLoader("plain", generator=torch.Generator().manual_seed(0), **kw))
    images = Cheap(N, os.devnull, image_bytes=CHEAP_BYTES).images
    for name in ("auto-on", "auto-off"):
        got = _epochs(RemoteDataLoader(name, generator=torch.Generator().manual_seed(0), **kw))
        for epoch in range(3):  # whatever auto decides, every epoch is the uncached one (auto-off's images are larger)
            assert_same_batches(_part(got[epoch], ("label", "index")), _part(plain[epoch], ("label", "index")), name)
            if name == "auto-on":
                assert_same_batches(got[epoch], plain[epoch], name)
            else:
                assert all(torch.equal(b["clean"], images[b["index"]]) for b in got[epoch])
    # Decided within the first epoch (the dataset is smaller than the trial): costly items are computed once,
    # cheap ones every epoch once the cache is off.
    assert computed(logs / "auto-on") == {i: 1 for i in range(N)}
    assert computed(logs / "auto-off") == {i: 3 for i in range(N)}
    by_name = {d.info.name: d.cache for d in daemon_status(daemon.address).datasets}
    assert (by_name["auto-on"].mode, by_name["auto-off"].mode, by_name["mem"].mode) == ("on", "off", "on")
    assert "caching pays" in by_name["auto-on"].decision and "does not pay" in by_name["auto-off"].decision
    assert not by_name["mem"].decision
    table = loaderd_cli("status", "--address", daemon.address).stdout
    assert "cache: auto for 'auto-off': caching does not pay" in table, table
    assert "cache: auto is off" in daemon.log() and "cache: auto is on" in daemon.log()
    samples = scrape(metrics_url(daemon.log()))
    on = {name: samples[("loaderd_cache_on", frozenset({"dataset": name, "tier": "memory"}.items()))] for name in ("auto-on", "auto-off", "mem")}
    assert on == {"auto-on": 1, "auto-off": 0, "mem": 1}


# ------------------------------------------------------------------ the disk tier


def _disk(tmp: Path, max_bytes: Any = "8MiB", **extra: Any) -> dict[str, Any]:
    return {"disk": str(tmp / "cache"), "max": max_bytes, **extra}


def _one_epoch(daemon: RunningDaemon, name: str = "disk") -> list[Any]:
    torch.manual_seed(5)
    return list(RemoteDataLoader(name, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1), address=daemon.address))


def _torch_epoch(salt: int = 0) -> list[Any]:
    torch.manual_seed(5)
    ds = Transformed(Counted(N, os.devnull, salt=salt))
    return list(DataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1)))


@pytest.mark.timeout(90)
def test_disk_cache_survives_restart_kill_and_a_second_daemon(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    datasets = {"disk": _spec(log, _disk(tmp_path))}
    # SIGKILLed while it fills the cache: whatever it committed is whole.
    with running_daemon(datasets, prefix="ld-ic-", workers=2, expect_running=False) as first:
        loader = iter(RemoteDataLoader("disk", batch_size=2, address=first.address))
        next(loader)
        first.stop(signal.SIGKILL)
    before_kill = computed(log)
    assert before_kill, "the killed daemon computed nothing"
    # Two daemons at once on the same disk cache: both yield torch's batches.
    with running_daemon(datasets, prefix="ld-ic-", workers=2) as a, running_daemon(datasets, prefix="ld-ic-", workers=2) as b:
        assert_same_batches(_part(_one_epoch(a)), _part(_torch_epoch()), "daemon a after the kill")
        assert_same_batches(_part(_one_epoch(b)), _part(_torch_epoch()), "daemon b")
    # Everything is on disk now: a restarted daemon computes nothing, and yields the same.
    done = computed(log)
    assert set(done) == set(range(N))
    with running_daemon(datasets, prefix="ld-ic-", workers=2) as restarted:
        assert_same_batches(_part(_one_epoch(restarted)), _part(_torch_epoch()), "restarted")
    assert computed(log) == done, "a restarted daemon computed items the disk cache holds"
    # A changed spec (kwargs) reads none of the old items; a version of its own starts afresh too.
    changed = {"disk": _spec(log, _disk(tmp_path), salt=3), "versioned": _spec(log, _disk(tmp_path, version="2"))}
    with running_daemon(changed, prefix="ld-ic-", workers=2) as other:
        assert_same_batches(_part(_one_epoch(other)), _part(_torch_epoch(salt=3)), "changed kwargs")
        _one_epoch(other, "versioned")
    after = computed(log)
    assert all(after[i] == done[i] + 2 for i in range(N)), "a changed spec read the old items"


@pytest.mark.timeout(60)
def test_cache_smaller_than_the_dataset_keeps_a_stable_subset(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    # 4 KiB items, 1 MiB map: LMDB's pages and tree take some; about half the 400 items fit.
    datasets = {"disk": _spec(log, _disk(tmp_path, 1 << 20), image_bytes=4096, n=400)}
    kept: list[set[int]] = []
    with running_daemon(datasets, prefix="ld-ic-", workers=2) as daemon:
        batches = []
        for epoch in range(3):
            before = computed(log)
            loader = RemoteDataLoader("disk", batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(epoch), address=daemon.address)
            batches.append(list(loader))
            now = computed(log)
            kept.append({i for i in range(400) if now[i] == before[i]})  # not computed this epoch: read from the cache
        oracle = DataLoader(Transformed(Counted(400, os.devnull, image_bytes=4096)), batch_size=16)
        assert_same_batches(_part(list(RemoteDataLoader("disk", batch_size=16, address=daemon.address))), _part(list(oracle)))
    assert kept[0] == set(), "the first epoch found items in a fresh cache"
    assert 0.25 * 400 < len(kept[1]) < 400, f"{len(kept[1])} of 400 items kept"
    assert kept[2] == kept[1], "what the full cache keeps changed between epochs"
