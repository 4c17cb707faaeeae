"""An elastic pool (``workers: {min, max}``) in a real daemon: it grows while the trainers wait, shrinks while they
pause, and every loader's batches are torch's all along: map-style, iterable, a share, DDP ranks, a resumed epoch."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support import datasets
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, daemon_status, loaderd_cli, oracle_loader, running_daemon, wait_for
from torch.utils.data import DataLoader, DistributedSampler

from loaderd import RemoteDataLoader
from loaderd.loader.identity import share_seed

pytestmark = pytest.mark.timeout(120)

N = 480  # Slow items of 5 ms: 120 batches of 4 per map-style epoch
DELAY = 0.005
BATCH = 4
DATASETS = {
    "slow": {"dataset": "support.datasets:Slow", "kwargs": {"n": N, "delay": DELAY}},
    "stream": {"dataset": "support.datasets:Stream", "kwargs": {"n": 200}},
}
# From SLOW_START s after the start, every trainer sleeps 0.2 s a batch (a GPU-bound step) until the daemon logs
# that the pool shrank, or SLOW_MOST s at most: a shrink takes a growth's check (SETTLE_S + MEASURE_S) and
# SHRINK_AFTER_S quiet, on top of the windows the fast phase filled, and a busy 2-core host needs longer.
SLOW_START = 2.0
SLOW_MOST = 20.0


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("elastic") / "once.txt"


@pytest.fixture(scope="module")
def daemon(records: Path) -> Iterator[RunningDaemon]:
    # A build: once dataset beside them: workers that join are forked from the fork server that built it.
    once = {"dataset": "support.datasets:Recorded", "kwargs": {"n": 8, "record": str(records)}, "build": "once"}
    with running_daemon({**DATASETS, "once": once}, prefix="ld-elastic-", workers={"min": 1, "max": 3}) as running:
        yield running


class SlowPhase:
    """Whether the trainers are in their slow phase: from ``SLOW_START`` until the daemon's log shows the pool
    shrinking after it grew (or ``SLOW_MOST``)."""

    def __init__(self, daemon: RunningDaemon, start: float) -> None:
        self._daemon, self._start = daemon, start
        self._over = threading.Event()

    def now(self) -> bool:
        elapsed = time.monotonic() - self._start
        if elapsed < SLOW_START or self._over.is_set():
            return False
        changes = pool_changes(self._daemon, open_streams_only=False)
        grown = next((i for i, c in enumerate(changes) if c.startswith("growing")), None)
        if elapsed >= SLOW_MOST or (grown is not None and any(c.startswith("shrinking") for c in changes[grown:])):
            self._over.set()
            return False
        return True


def paced(batches: Iterator[Any], slow: SlowPhase) -> list[Any]:
    """Take every batch, as fast as they come but in the slow phase."""
    out = []
    for batch in batches:
        out.append(batch)
        if slow.now():
            time.sleep(0.2)
    return out


def run_all(consumers: dict[str, Callable[[], list[Any]]]) -> dict[str, list[Any]]:
    """Each consumer in its own thread, at once; their batches (or the first error, raised here)."""
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        try:
            results[name] = consumers[name]()
        except BaseException as exc:  # re-raised below, in the test's thread
            results[name] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in consumers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    for result in results.values():
        if isinstance(result, BaseException):
            raise result
    assert set(results) == set(consumers), "a consumer did not finish within 90 s"
    return results


def pool_changes(daemon: RunningDaemon, open_streams_only: bool = True) -> list[str]:
    """The pool's changes in order; with ``open_streams_only``, those while streams were open (before the
    last one ended)."""
    log = daemon.log()
    if open_streams_only:
        log = log[: log.rfind("ended by the client")]
    return re.findall(r"pool: .*(growing to \d+|shrinking to \d+|back to \d+)", log)


def test_the_pool_resizes_under_every_kind_of_loader_and_loses_nothing(daemon: RunningDaemon, records: Path) -> None:
    address = daemon.address
    assert daemon_status(address).pool.workers == 1, "an elastic pool starts with its fewest workers"
    ds = datasets.Slow(N, 0.0)
    slow = SlowPhase(daemon, time.monotonic())
    resumed_head: list[Any] = []

    def map_style() -> list[Any]:
        loader = RemoteDataLoader("slow", batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(3), address=address)
        return paced(iter(loader), slow)

    def iterable() -> list[Any]:
        return paced(iter(RemoteDataLoader("stream", batch_size=BATCH, num_workers=2, address=address)), slow)

    def shared() -> list[Any]:
        return paced(iter(RemoteDataLoader("slow", batch_size=BATCH, shuffle=True, share="elastic", address=address)), slow)

    def rank(r: int) -> Callable[[], list[Any]]:
        def run() -> list[Any]:
            loader = RemoteDataLoader("slow", batch_size=BATCH, shuffle=True, seed=5, rank=r, world_size=2, address=address)
            return paced(iter(loader), slow)

        return run

    def resumed() -> list[Any]:
        # Its own generator: the other threads draw from the global one meanwhile.
        first = RemoteDataLoader("slow", batch_size=BATCH, generator=torch.Generator().manual_seed(11), address=address)
        batches = iter(first)
        resumed_head.extend(next(batches) for _ in range(30))
        state = first.state_dict()
        del batches
        second = RemoteDataLoader("slow", batch_size=BATCH, generator=torch.Generator(), address=address)
        second.load_state_dict(state)
        return paced(iter(second), slow)

    got = run_all(
        {"map": map_style, "iterable": iterable, "share-a": shared, "share-b": shared, "rank0": rank(0), "rank1": rank(1), "resumed": resumed}
    )

    assert_same_batches(got["map"], list(oracle_loader(ds, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(3))))
    assert_same_batches(got["iterable"], list(oracle_loader(datasets.Stream(200), batch_size=BATCH, num_workers=2)))
    share_order = torch.Generator().manual_seed(share_seed("elastic", 0, 0))
    expected_share = list(oracle_loader(ds, batch_size=BATCH, shuffle=True, generator=share_order))
    assert_same_batches(got["share-a"], expected_share)
    assert_same_batches(got["share-b"], expected_share)
    for r in (0, 1):
        sampler = DistributedSampler(ds, num_replicas=2, rank=r, shuffle=True, seed=5)
        assert_same_batches(got[f"rank{r}"], list(DataLoader(ds, batch_size=BATCH, sampler=sampler)))
    assert_same_batches(resumed_head + got["resumed"], list(oracle_loader(ds, batch_size=BATCH)))

    changes = pool_changes(daemon)
    assert any(c.startswith("growing") for c in changes), daemon.log()
    grown = changes.index(next(c for c in changes if c.startswith("growing")))
    assert any(c.startswith("shrinking") for c in changes[grown:]), f"no shrink in the slow phase: {changes}\n{daemon.log()}"
    shrunk = max(i for i, c in enumerate(changes) if c.startswith("shrinking"))
    assert any(c.startswith("growing") for c in changes[shrunk:]), f"no growth after the slow phase: {changes}"
    # Once every trainer is gone, the pool goes back to its fewest workers, and says why.
    try:
        wait_for(lambda: daemon_status(address).pool.workers == 1, 20, "the pool back to 1 worker")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{daemon.log()}") from None
    pool = daemon_status(address).pool
    assert (pool.elastic, pool.min_workers, pool.max_workers, pool.target) == (True, 1, 3, 1)
    assert "shrinking to 1" in pool.reason and pool.busy_s > 0 and pool.starved_s > 0
    text = loaderd_cli("status", "--address", address).stdout
    assert "pool: 1 worker (elastic, 1 to 3; target 1): " in text, text
    assert [w.worker_id for w in daemon_status(address).workers] == [0], "a worker that left is no longer listed"
    assert len(records.read_text().split()) == 1, "the build: once dataset was built once, however many workers joined"
