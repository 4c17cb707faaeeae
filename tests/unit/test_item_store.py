"""The item cache's store and codec (server/cache/) against a temp dir, and its config keys."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.compare import assert_same

from loaderd.server.cache.auto import MEASURING, OFF, ON, AutoCache, AutoCaches
from loaderd.server.cache.item_codec import CorruptRecord, decode_item, encode_item, unfaithful
from loaderd.server.cache.item_store import ItemStore
from loaderd.server.cache.location import fingerprint
from loaderd.server.cache.usage import CacheDelta
from loaderd.server.config.document import auto_memory_bytes
from loaderd.server.config.schema import CacheSpec, ConfigError, DatasetSpec, parse_config

Point = collections.namedtuple("Point", ["x", "y"])
ITEM = {
    "image": torch.arange(12, dtype=torch.uint8).reshape(3, 4),
    "arr": np.ones((2, 2)),
    "label": 3,
    "f": 0.5,
    "np": np.float32(2.5),
    "name": "a",
    "raw": b"xy",
    "none": None,
    "pair": (torch.zeros(0), [True]),
    "pt": Point(1, 2.0),
}


@pytest.mark.timeout(10)
def test_codec_round_trip_is_faithful_and_writable() -> None:
    assert unfaithful(ITEM) is None
    got = decode_item(memoryview(bytes(encode_item(ITEM))))
    assert_same(got, ITEM)
    assert type(got["pt"]) is Point
    got["image"] += 1  # a transform may work in place: the item's memory is its own
    with pytest.raises(CorruptRecord):
        decode_item(memoryview(b"not a record at all"))


@pytest.mark.timeout(10)
def test_unfaithful_names_what_the_cache_would_change() -> None:
    assert "set" in str(unfaithful({"a": {1, 2}}))
    assert unfaithful([torch.nn.Parameter(torch.zeros(1))]) is not None  # a tensor subclass
    assert unfaithful(torch.zeros(1, requires_grad=True)) is not None
    assert unfaithful(np.array([object()])) is not None
    assert unfaithful(collections.defaultdict(int)) is not None


def _store(tmp_path: Path, max_bytes: int = 1 << 20) -> ItemStore:
    return ItemStore("ds", str(tmp_path / "items.mdb"), max_bytes, durable=False)


@pytest.mark.timeout(10)
def test_store_keeps_items_by_index_across_opens(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.get_many([0, 1]) == {}
    store.put_many([1, 7], [ITEM, {"x": torch.ones(3)}])
    store.put_many([1], [{"other": 1}])  # never overwrites what is there
    store.close()
    again = _store(tmp_path)
    found = again.get_many([7, 1, 2, 1])
    assert sorted(found) == [0, 1, 3]  # by position; an index twice is two objects
    assert_same(found[1], ITEM)
    assert found[1] is not found[3]
    assert (again.stats.hits, again.stats.misses) == (3, 1)


@pytest.mark.timeout(20)
def test_full_store_keeps_what_it_has(tmp_path: Path) -> None:
    store = _store(tmp_path)
    item = {"x": torch.zeros(64 << 10, dtype=torch.uint8)}  # 64 KiB each: ~15 fit in 1 MiB
    for i in range(40):
        store.put_many([i], [item])
    assert store.full
    kept = set(store.get_many(list(range(40))))
    assert 5 < len(kept) < 40 and kept == set(range(len(kept)))  # the first ones, none evicted
    store.put_many([100], [{"x": torch.zeros(1)}])
    assert set(store.get_many(list(range(40)))) == kept and not store.get_many([100])


@pytest.mark.timeout(10)
def test_store_skips_what_the_codec_would_change(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = _store(tmp_path)
    store.put_many([0, 1, 2], [{"a": {1}}, {"a": {2}}, {"a": 1}])
    assert sorted(store.get_many([0, 1, 2])) == [2]
    assert store.stats.not_stored == 2
    assert sum("not cached" in r.getMessage() for r in caplog.records) == 1  # once per dataset


@pytest.mark.timeout(10)
def test_fingerprint_follows_the_spec() -> None:
    cache = CacheSpec(tier="memory", max_bytes=1 << 20)
    base = DatasetSpec(name="a", factory="m:f", kwargs={"n": 1})
    assert fingerprint(base, cache) == fingerprint(DatasetSpec(name="b", factory="m:f", kwargs={"n": 1}, transform="m:t"), cache)
    others: list[Any] = [
        (DatasetSpec(name="a", factory="m:g", kwargs={"n": 1}), cache),
        (DatasetSpec(name="a", factory="m:f", kwargs={"n": 2}), cache),
        (DatasetSpec(name="a", factory="m:f", args=(1,), kwargs={"n": 1}), cache),
        (base, CacheSpec(tier="memory", max_bytes=1 << 20, version="2")),
    ]
    assert len({fingerprint(s, c) for s, c in others} | {fingerprint(base, cache)}) == 5


@pytest.mark.timeout(10)
def test_config_cache_and_transform_keys(tmp_path: Path) -> None:
    def parse(entry: dict[str, Any]) -> DatasetSpec:
        return parse_config({"datasets": {"a": {"dataset": "m:f", **entry}}}, tmp_path / "ds.yaml").datasets["a"]

    spec = parse({"transform": "m:t", "cache": {"memory": "4GiB"}})
    assert spec.transform == "m:t" and spec.cache == CacheSpec(tier="memory", max_bytes=4 << 30)
    disk = parse({"cache": {"disk": "c", "max": "1.5GB", "version": 3}}).cache
    assert disk == CacheSpec(tier="disk", max_bytes=1_500_000_000, path=tmp_path / "c", version="3")
    auto = parse({"cache": "auto"}).cache
    assert auto is not None and auto.auto and auto.tier == "memory" and auto.max_bytes == auto_memory_bytes(1)
    two = parse_config({"datasets": {n: {"dataset": "m:f", "cache": "auto"} for n in "ab"}}, tmp_path / "ds.yaml").datasets
    assert two["a"].cache == two["b"].cache and two["a"].cache is not None  # two auto caches split the bound
    assert two["a"].cache.max_bytes == auto_memory_bytes(2) <= auto_memory_bytes(1) // 2 + (1 << 20)
    assert parse({"cache": {"disk": "c", "max": "1GiB", "auto": True}}).cache == CacheSpec(
        tier="disk", max_bytes=1 << 30, path=tmp_path / "c", auto=True
    )
    for bad, words in [
        ("automatic", "'auto', or a mapping"),
        ({"disk": "c"}, "needs 'max"),
        ({"memory": 5}, "at least 1048576"),
        ({"memory": "4 parsecs"}, "is not a size"),
        ({}, "either 'memory"),
        ({"memory": "2MiB", "max": "2MiB"}, "'max' goes with 'disk'"),
    ]:
        with pytest.raises(ConfigError, match=words):
            parse({"cache": bad})


@pytest.mark.timeout(10)
def test_cache_refused_for_an_iterable_dataset() -> None:
    from loaderd.server.worker.datasets import build_for_worker

    spec = DatasetSpec(name="s", factory="support.datasets:Stream", cache=CacheSpec(tier="memory", max_bytes=1 << 20))
    with pytest.raises(RuntimeError, match="dataset 's'.*IterableDataset.*cache:"):
        build_for_worker(spec, 0, 1, prebuilt=False)


@pytest.mark.timeout(10)
def test_items_go_to_the_transform_as_a_hit_gives_them(tmp_path: Path) -> None:
    store = _store(tmp_path)
    hwc = torch.arange(2 * 3 * 4, dtype=torch.uint8).reshape(2, 3, 4)
    item = {"image": hwc.permute(2, 0, 1), "arr": np.ones((3, 2)).T, "label": 1}  # channels-first views, not contiguous
    handed = store.put_many([5, 5], [item, item])
    assert handed[0] is not handed[1]  # an index twice is two objects, stored once
    hit = store.get_many([5])[0]
    for got in (handed[0], hit):
        assert got["image"].is_contiguous() and got["arr"].flags.c_contiguous
        assert_same(got, item)
    assert store.stats.stored == 1


@pytest.mark.timeout(10)
def test_a_store_that_cannot_write_is_full_and_fails_no_batch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import resource
    import signal

    store = _store(tmp_path, 8 << 20)
    store.put_many([0], [{"x": torch.zeros(1)}])
    # A file size limit makes the next writes fail as a full file system would (EFBIG, not SIGXFSZ: ignored).
    size = (tmp_path / "items.mdb").stat().st_size
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, old_limit[1]))
    try:
        handed = store.put_many([1, 2], [{"x": torch.zeros(64 << 10)}] * 2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert len(handed) == 2 and store.full and store.stats.not_stored == 2
    assert any("cannot write" in r.getMessage() for r in caplog.records)
    assert sorted(store.get_many([0, 1, 2])) == [0]  # what it had is still there


def _delta(**counts: Any) -> CacheDelta:
    return CacheDelta(**{"hits": 0, "misses": 0, "stored_bytes": 0, "not_stored": 0, "miss_cpu_s": 0.0, **counts})


@pytest.mark.timeout(10)
def test_auto_cache_decides_once_from_the_first_items() -> None:
    # Costly items that read back fast and fit: on, after the first TRIAL_ITEMS.
    pays = AutoCache("a", capacity_bytes=1 << 30, length=1000)
    batch = _delta(misses=64, miss_cpu_s=64 * 3e-3, stored=64, stored_bytes=64 * 200_000, store_cpu_s=64 * 2e-4,
                   read_items=64, read_cpu_s=64 * 1e-4)  # fmt: skip
    assert pays.add(batch) is None and pays.decision.mode == MEASURING
    decided = pays.add(batch)
    assert decided is not None and decided.mode == ON and "3 ms" in decided.reason and "holds all 1,000" in decided.reason
    assert pays.add(batch) is None  # decided once
    # Reading back costs more than half of computing: off.
    cheap = AutoCache("b", 1 << 30, 10_000)
    cheap.add(_delta(misses=128, miss_cpu_s=128 * 1e-4, stored=128, stored_bytes=128 * 1000, read_items=128, read_cpu_s=128 * 6e-5))
    assert cheap.decision.mode == OFF and "does not pay" in cheap.decision.reason
    # Pays, but the cache would hold under a tenth: off, saying so.
    small = AutoCache("c", 100 << 20, 100_000)
    small.add(_delta(misses=128, miss_cpu_s=1.0, stored=128, stored_bytes=128 * 200_000, read_items=128, read_cpu_s=0.01))
    assert small.decision.mode == OFF and "too small" in small.decision.reason
    # A store that already holds the items (a disk tier): on from its hits.
    held = AutoCache("d", 1 << 30, 1000)
    held.add(_delta(hits=128, read_items=128, read_cpu_s=0.01))
    assert held.decision.mode == ON and "already holds" in held.decision.reason
    # A daemon that sees part of the dataset (one node's ranks) computes fewer than the trial: its hits count,
    # and it still decides by the costs (not "already holds", which is for a store it never wrote to).
    part = AutoCache("p", 1 << 30, 1000)
    part.add(_delta(misses=40, miss_cpu_s=40 * 1e-4, stored=40, stored_bytes=40_000, read_items=40, read_cpu_s=40 * 1e-4))
    assert part.decision.mode == MEASURING
    part.add(_delta(hits=100, read_items=100, read_cpu_s=100 * 1e-4))
    assert part.decision.mode == OFF and "does not pay" in part.decision.reason
    # A dataset smaller than the trial decides after all of its items.
    tiny = AutoCache("e", 1 << 30, 40)
    tiny.add(_delta(misses=40, miss_cpu_s=0.4, stored=40, stored_bytes=40_000, read_items=40, read_cpu_s=0.001))
    assert tiny.decision.mode == ON


@pytest.mark.timeout(10)
def test_auto_caches_tell_off_once_and_what_a_new_worker_needs() -> None:
    dropped: list[str] = []
    caches = AutoCaches({"a": AutoCache("a", 1 << 30, 10), "b": AutoCache("b", 1 << 30, 10)}, dropped.append)
    assert caches.settled() == {}
    caches.add("a", _delta(misses=10, miss_cpu_s=1e-4, stored=10, stored_bytes=10_000, read_items=10, read_cpu_s=1e-3))
    caches.add("b", _delta(misses=10, miss_cpu_s=1.0, stored=10, stored_bytes=10_000, read_items=10, read_cpu_s=1e-3))
    caches.add("a", _delta(misses=10, miss_cpu_s=1.0))
    assert dropped == ["a"] and caches.settled() == {"a": False, "b": True}
    assert caches.add("nope", _delta(misses=1)) is None
