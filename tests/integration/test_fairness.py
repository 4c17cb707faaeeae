"""Fair multi-tenancy: a client that stops reading holds at most its window and
slows nobody; concurrent clients on several datasets all get exact epochs."""

from __future__ import annotations

import signal
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support import datasets
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, client_process, daemon_status, oracle_loader, running_daemon, wait_for

from loaderd import RemoteDataLoader

ITEM_DELAY_S = 0.002
READER_N = 240
BATCH = 8


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    slow = {"dataset": "support.datasets:Slow", "kwargs": {"n": READER_N, "delay": ITEM_DELAY_S}}
    with running_daemon(
        {
            "reader": slow,
            "held": {"dataset": "support.datasets:Slow", "kwargs": {"n": 4000, "delay": 0.0}},
            "held_stream": {"dataset": "support.datasets:Stream", "kwargs": {"n": 4000}},
            "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 301}},
            "structured": {"dataset": "support.datasets:Structured", "kwargs": {"n": 97}},
        },
        prefix="ld-fair-",
        workers=2,
    ) as running:
        yield running



def _computed(address: str, dataset: str) -> int:
    return next(d.batches_computed for d in daemon_status(address).datasets if d.info.name == dataset)


_STALLED_CLIENT = """
import signal, sys
from loaderd import RemoteDataLoader
name, address, kind = sys.argv[1:4]
if kind == "map":
    loader = RemoteDataLoader(name, batch_size=8, prefetch_factor=2, address=address)
else:
    loader = RemoteDataLoader(name, batch_size=8, num_workers=2, prefetch_factor=2, address=address)
it = iter(loader)
next(it)
print("stalled", flush=True)
signal.pause()  # hold the iterator, read nothing more, until the test kills this process
"""


def _reader_epoch(address: str) -> float:
    """Seconds for one epoch of the reader, checked against torch."""
    started = time.perf_counter()
    got = list(RemoteDataLoader("reader", batch_size=BATCH, address=address))
    elapsed = time.perf_counter() - started
    assert_same_batches(got, list(oracle_loader(datasets.Slow(READER_N, 0.0), batch_size=BATCH)))
    return elapsed


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_stalled_client_holds_only_its_window(daemon: RunningDaemon, kind: str) -> None:
    name = "held" if kind == "map" else "held_stream"
    before = _computed(daemon.address, name)
    with client_process(_STALLED_CLIENT, name, daemon.address, kind) as stalled:
        stalled.read_until(lambda line: line.startswith("stalled"), 60, "the client did not take its first batch")
        window = 2 * 2  # prefetch_factor x pool workers (map) or x num_workers (iterable)
        # The daemon fills the window the client gave it, then stops working for it.
        wait_for(lambda: _computed(daemon.address, name) - before >= window, 30, "the stalled client's window")
        _reader_epoch(daemon.address)  # the pool keeps serving others meanwhile
        held = _computed(daemon.address, name) - before
        assert window <= held <= window + 1, f"a stalled client got {held} batches made for it (window {window})"
        streams = [s for s in daemon_status(daemon.address).streams if s.dataset == name]
        assert len(streams) == 1 and streams[0].window == window


_TOGGLED_CLIENT = """
import signal, sys
# Blocked before any thread exists (every thread inherits the mask), then waited for:
# a SIGUSR1 sent before the wait stays pending instead of being lost.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
from loaderd import RemoteDataLoader
name, address = sys.argv[1:3]
loader = RemoteDataLoader(name, batch_size=8, prefetch_factor=2, address=address)
while True:
    it = iter(loader)
    next(it)
    print("stalled", flush=True)
    signal.sigwait({signal.SIGUSR1})  # hold the iterator and read nothing until told
    it.close()
    print("released", flush=True)
    signal.sigwait({signal.SIGUSR1})  # no stream at all until told
"""


def test_reader_keeps_its_throughput_beside_a_stalled_client(daemon: RunningDaemon) -> None:
    """The issue asks for >= 90% of solo throughput; the items sleep, so CPU noise barely matters.

    Alone and beside rounds alternate (one client process toggled by SIGUSR1) so that
    machine noise lands on both sides; the verdict is the median of the per-pair ratios.
    """
    _reader_epoch(daemon.address)  # warm
    ratios: list[str] = []
    with client_process(_TOGGLED_CLIENT, "held", daemon.address) as other:
        other.read_until(lambda line: line == "stalled\n", 60, "the client did not take its first batch")
        values: list[float] = []
        for _ in range(5):
            beside = _reader_epoch(daemon.address)
            other.process.send_signal(signal.SIGUSR1)
            other.read_until(lambda line: line == "released\n", 30, "the client did not close its iterator")
            alone = _reader_epoch(daemon.address)
            other.process.send_signal(signal.SIGUSR1)
            other.read_until(lambda line: line == "stalled\n", 30, "the client did not stall again")
            values.append(alone / beside)
            ratios.append(f"{alone:.3f}/{beside:.3f}")
    assert statistics.median(values) >= 0.9, f"alone/beside a stalled client, per pair (s): {ratios}"


def test_concurrent_clients_on_several_datasets_get_exact_epochs(daemon: RunningDaemon) -> None:
    """Threads of one process and the pool's round-robin: each epoch is torch's, none starves."""
    cases: list[tuple[str, Any, dict[str, Any]]] = [
        ("squares", datasets.Squares(301), {"batch_size": 7}),
        ("squares", datasets.Squares(301), {"batch_size": 16, "drop_last": True}),
        ("structured", datasets.Structured(97), {"batch_size": 5}),
        ("reader", datasets.Slow(READER_N, 0.0), {"batch_size": 12}),
    ]
    results: dict[int, list[Any]] = {}
    errors: list[BaseException] = []

    def run(i: int, name: str, kwargs: dict[str, Any]) -> None:
        try:
            loader = RemoteDataLoader(name, address=daemon.address, **kwargs)
            results[i] = [batch for _ in range(2) for batch in loader]
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, name, kw)) for i, (name, _, kw) in enumerate(cases)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert not errors, errors
    for i, (_, dataset, kwargs) in enumerate(cases):
        oracle = oracle_loader(dataset, **kwargs)
        assert_same_batches(results[i], [batch for _ in range(2) for batch in oracle])
