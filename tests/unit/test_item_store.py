"""The item cache's store and codec (server/cache/) against a temp dir, and its config keys."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.compare import assert_same

from loaderd.server.cache.item_codec import CorruptRecord, decode_item, encode_item, unfaithful
from loaderd.server.cache.item_store import ItemStore
from loaderd.server.cache.location import fingerprint
from loaderd.server.config.schema import CacheSpec, ConfigError, DatasetSpec, parse_config

Point = collections.namedtuple("Point", ["x", "y"])
ITEM = {"image": torch.arange(12, dtype=torch.uint8).reshape(3, 4), "arr": np.ones((2, 2)), "label": 3, "f": 0.5,
        "np": np.float32(2.5), "name": "a", "raw": b"xy", "none": None, "pair": (torch.zeros(0), [True]), "pt": Point(1, 2.0)}


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
    store.put_many({1: ITEM, 7: {"x": torch.ones(3)}})
    store.put_many({1: {"other": 1}})  # never overwrites what is there
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
        store.put_many({i: item})
    assert store.full
    kept = set(store.get_many(list(range(40))))
    assert 5 < len(kept) < 40 and kept == set(range(len(kept)))  # the first ones, none evicted
    store.put_many({100: {"x": torch.zeros(1)}})
    assert set(store.get_many(list(range(40)))) == kept and not store.get_many([100])


@pytest.mark.timeout(10)
def test_store_skips_what_the_codec_would_change(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = _store(tmp_path)
    store.put_many({0: {"a": {1}}, 1: {"a": {2}}, 2: {"a": 1}})
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
    for bad, words in [
        ("auto", "not supported yet"),
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
