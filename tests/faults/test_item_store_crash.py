"""The item cache's store (server/cache/item_store.py) when writers die or race, with real processes.

A writer SIGKILLed inside its write transaction (between two items of one batch's commit) leaves
the last committed state: none of that batch's items, every earlier one whole, and a store the
next writer takes over at once. Two processes writing the same keys item by item, at once,
store each item exactly once, and every record reads back as its own item.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from loaderd.server.cache.item_store import ItemStore

MAX = 64 << 20


def _item(key: int) -> dict[str, object]:
    return {"image": torch.full((3, 64, 64), key % 251, dtype=torch.uint8), "key": key}


_CHILD = """
import os, signal, sys, time
from pathlib import Path
import torch
from loaderd.server.cache.item_store import ItemStore

def item(key):
    return {{"image": torch.full((3, 64, 64), key % 251, dtype=torch.uint8), "key": key}}

store = ItemStore("ds", {path!r}, {max_bytes}, durable=True)
{body}
"""


def _child(path: Path, body: str) -> subprocess.Popen[bytes]:
    code = _CHILD.format(path=str(path), max_bytes=MAX, body=textwrap.dedent(body))
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)


@pytest.mark.timeout(60)
def test_writer_killed_inside_its_transaction_leaves_the_last_commit(tmp_path: Path) -> None:
    path = tmp_path / "items.mdb"
    marker = tmp_path / "in-transaction"
    # Batch one commits; batch two is killed while its transaction is open, after two of its items were put.
    child = _child(
        path,
        f"""
        store.put_many(list(range(10)), [item(k) for k in range(10)])
        lay_out = store._writer.record
        calls = []
        def record(it):
            calls.append(it)
            if len(calls) == 3:  # items 10 and 11 are in the open transaction: die before 12
                Path({str(marker)!r}).touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return lay_out(it)
        store._writer.record = record
        store.put_many(list(range(10, 20)), [item(k) for k in range(10, 20)])
        sys.exit(3)  # not reached
    """,
    )
    try:
        _, err = child.communicate(timeout=50)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert child.returncode == -signal.SIGKILL, err.decode()
    assert marker.exists(), "the child died before its second transaction"
    store = ItemStore("ds", str(path), MAX, durable=True)
    found = store.get_many(list(range(20)))
    assert sorted(found) == list(range(10)), "a killed transaction's items are visible (or a committed one's lost)"
    for key, got in found.items():
        assert torch.equal(got["image"], _item(key)["image"]) and got["key"] == key
    # The killed writer held LMDB's writer lock: the next writer gets it at once (robust mutex), not after a timeout.
    started = time.monotonic()
    store.put_many(list(range(10, 20)), [_item(k) for k in range(10, 20)])
    assert time.monotonic() - started < 5
    assert sorted(store.get_many(list(range(20)))) == list(range(20))
    store.close()


@pytest.mark.timeout(90)
def test_two_writers_of_the_same_items_at_once_store_each_once(tmp_path: Path) -> None:
    path = tmp_path / "items.mdb"
    go = tmp_path / "go"
    keys = 300
    # One item per transaction, one writer upwards and one downwards: they meet in the middle, item by item.
    # Each says it is ready (store open), then waits for go (60 s at most: a parent that died leaves no poller).
    body = f"""
        Path({str(tmp_path)!r}, "ready-{{name}}").touch()
        deadline = time.monotonic() + 60
        while not Path({str(go)!r}).exists():
            if time.monotonic() > deadline:
                sys.exit(4)
            time.sleep(0.001)
        for key in {{order}}:
            store.put_many([key], [item(key)])
        print(store.stats.stored, file=sys.stderr)
    """
    children = [
        _child(path, body.format(name="up", order=f"range({keys})")),
        _child(path, body.format(name="down", order=f"range({keys} - 1, -1, -1)")),
    ]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready-{name}").exists() for name in ("up", "down")):
            assert time.monotonic() < deadline, "the writers did not start"
            assert all(c.poll() is None for c in children), "a writer exited before it was ready"
            time.sleep(0.01)
        go.touch()
        stored = []
        for child in children:
            _, err = child.communicate(timeout=60)
            assert child.returncode == 0, err.decode()
            stored.append(int(err.decode().split()[-1]))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(10)
    assert sum(stored) == keys, f"stored {stored}: an item twice, or one lost"
    assert min(stored) > 0, f"stored {stored}: the writers did not overlap"
    store = ItemStore("ds", str(path), MAX, durable=True)
    found = store.get_many(list(range(keys)))
    assert sorted(found) == list(range(keys))
    assert all(torch.equal(found[k]["image"], _item(k)["image"]) and found[k]["key"] == k for k in range(keys))
    store.close()
