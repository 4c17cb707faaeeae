"""Failures: user exceptions, timeouts, dying workers, vanishing clients, bad requests.

Most tests share one module daemon (starting one costs seconds). Tests that
kill pool workers on purpose get a daemon of their own (``start_daemon``), so
their log and their worker deaths are theirs alone.
"""

from __future__ import annotations

import gc
import re
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import datasets
from support.compare import assert_same, assert_same_batches
from support.daemons import RunningDaemon, client_process, oracle_loader, running_daemon, wait_for
from torch.utils.data import DataLoader

import loaderd
from loaderd import RemoteDataLoader
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.v1 import loaderd_pb2_grpc
from loaderd.wire.limits import PROTOCOL_REVISION

FAILING_N = 20
SLOW_N = 1000
# Batches of 10000 int64 values are 80 KiB, over the daemon's 64 KiB inline
# threshold: on the shm transport they travel through shared-memory slots.
BIG_BATCH = 10000
FAILING_BIG_N = 35000
SQUARES_BIG_N = 20480

DATASETS = {
    "failing-value": {"dataset": "support.datasets:Failing", "kwargs": {"n": FAILING_N, "bad": [5], "kind": "ValueError"}},
    "failing-key": {"dataset": "support.datasets:Failing", "kwargs": {"n": FAILING_N, "bad": [5, 12], "kind": "KeyError"}},
    "failing-custom": {"dataset": "support.datasets:Failing", "kwargs": {"n": FAILING_N, "bad": [0, 19], "kind": "Custom"}},
    # range(..., "oops") raises TypeError from inside the replica's iterator (its first next()).
    "broken-stream": {"dataset": "support.datasets:Stream", "kwargs": {"n": "oops"}},
    "slow": {"dataset": "support.datasets:Slow", "kwargs": {"n": SLOW_N, "delay": 0.05}},
    "very-slow": {"dataset": "support.datasets:Slow", "kwargs": {"n": 2, "delay": 2.0}},
    "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 100}},
    "failing-big": {
        "dataset": "support.datasets:Failing",
        "kwargs": {"n": FAILING_BIG_N, "bad": [5, 12000], "kind": "ValueError"},
    },
    "squares-big": {"dataset": "support.datasets:Squares", "kwargs": {"n": SQUARES_BIG_N}},
}

LOCAL_FAILING = {
    "failing-value": lambda: datasets.Failing(FAILING_N, (5,), "ValueError"),
    "failing-key": lambda: datasets.Failing(FAILING_N, (5, 12), "KeyError"),
    "failing-custom": lambda: datasets.Failing(FAILING_N, (0, 19), "Custom"),
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    """One `loaderd serve` (2 pool workers) shared by this module's tests; checked at teardown."""
    with running_daemon(DATASETS, prefix="ld-fail-") as running:
        yield running


# ------------------------------------------------------------------ helpers


def outcomes(loader: Any, limit: int = 500) -> list[Any]:
    """Every next() of one epoch: the batch, or the exception it raised (iteration goes on)."""
    results: list[Any] = []
    it = iter(loader)
    for _ in range(limit):
        try:
            batch = next(it)
        except StopIteration:
            return results
        except Exception as exc:
            results.append(exc)
        else:
            results.append(batch)
    raise AssertionError(f"the epoch did not end within {limit} next() calls: {results[-5:]}")


def assert_same_outcomes(got: list[Any], want: list[Any]) -> None:
    def show(items: list[Any]) -> list[str]:
        return [type(x).__name__ if isinstance(x, BaseException) else repr(x) for x in items]

    assert len(got) == len(want), f"{len(got)} outcomes, torch gives {len(want)}:\n got {show(got)}\nwant {show(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, BaseException):
            assert type(g) is type(w), f"next() #{i}: got {show([g])}, torch raised {type(w).__name__}: {g!r}"
        else:
            assert not isinstance(g, BaseException), f"next() #{i}: raised {g!r}, torch gave {w!r}"
            assert_same(g, w, f"next() #{i}")


def last_line(message: str) -> str:
    return message.rstrip().splitlines()[-1]


def health_status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5.0).status


def assert_serving(daemon: RunningDaemon) -> None:
    assert daemon.process.poll() is None, f"daemon exited with {daemon.process.returncode}:\n{daemon.log()}"
    assert health_status(daemon.address) == health_pb2.HealthCheckResponse.SERVING


def assert_squares_epoch(daemon: RunningDaemon, transport: str) -> None:
    """A fresh loader on the daemon gets a full, correct epoch."""
    got = list(RemoteDataLoader("squares", batch_size=16, address=daemon.address, transport=transport))
    assert_same_batches(got, list(DataLoader(datasets.Squares(100), batch_size=16)), "squares")


def receiver_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "loaderd-receiver" and t.is_alive()}


# ------------------------------------------------------------------ user exceptions


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch_size", [3, None], ids=["batch3", "unbatched"])
@pytest.mark.parametrize(
    ("name", "exc_type", "text"),
    [
        ("failing-value", ValueError, "bad item 5"),
        ("failing-key", KeyError, "no key for 5"),
        ("failing-custom", datasets.CustomError, "custom failure at 0"),
    ],
    ids=["ValueError", "KeyError", "CustomError"],
)
def test_user_exception_reaches_client_and_iteration_continues(
    daemon: RunningDaemon, transport: str, name: str, exc_type: type[Exception], text: str, batch_size: int | None
) -> None:
    got = outcomes(
        RemoteDataLoader(name, batch_size=batch_size, num_workers=2, address=daemon.address, transport=transport)
    )
    want = outcomes(oracle_loader(LOCAL_FAILING[name](), batch_size=batch_size, num_workers=2))
    assert any(isinstance(w, exc_type) for w in want), "the oracle raised nothing: the test is broken"
    assert_same_outcomes(got, want)
    errors = [g for g in got if isinstance(g, BaseException)]
    for error, oracle_error in zip(errors, [w for w in want if isinstance(w, BaseException)]):
        assert type(error) is exc_type
        message = str(error)
        # The remote traceback, ending with the same exception line torch shows.
        assert "Traceback" in message and "__getitem__" in message, message
        assert last_line(message) == last_line(str(oracle_error)), message
    assert text in str(errors[0]), str(errors[0])
    # The failed batch is named by its indices too (the daemon knows them; the client's traceback does not show them).
    bad = {"failing-value": 5, "failing-key": 5, "failing-custom": 0}[name]
    named = f"(index {bad})" if batch_size is None else f"(indices {list(range(bad - bad % 3, bad - bad % 3 + 3))})"
    assert named in str(errors[0]), str(errors[0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [4, None], ids=["batch4", "unbatched"])
def test_exception_in_iterable_dataset_iterator_arrives(
    daemon: RunningDaemon, transport: str, num_workers: int, batch_size: int | None
) -> None:
    got = outcomes(
        RemoteDataLoader(
            "broken-stream", batch_size=batch_size, num_workers=num_workers, address=daemon.address, transport=transport
        )
    )
    want = outcomes(oracle_loader(datasets.Stream("oops"), batch_size=batch_size, num_workers=num_workers))
    assert want and all(isinstance(w, TypeError) for w in want), f"oracle: {want!r}"
    assert_same_outcomes(got, want)
    for error, oracle_error in zip(got, want):
        message = str(error)
        assert "cannot be interpreted as an integer" in message, message
        assert "Traceback" in message and "__iter__" in message, message
        # torch re-raises a worker's error with its traceback in the message; without workers, the error itself.
        oracle_line = last_line(str(oracle_error) if num_workers else "".join(traceback.format_exception_only(oracle_error)))
        assert last_line(message) == oracle_line, message


@pytest.mark.timeout(60)
def test_user_exception_between_large_batches(daemon: RunningDaemon, transport: str) -> None:
    """Error batches among batches big enough for shared-memory slots (and an inline tail)."""
    loader = RemoteDataLoader("failing-big", batch_size=BIG_BATCH, address=daemon.address, transport=transport)
    local = datasets.Failing(FAILING_BIG_N, (5, 12000), "ValueError")
    want = outcomes(oracle_loader(local, batch_size=BIG_BATCH, num_workers=2))
    assert [type(w).__name__ for w in want] == ["ValueError", "ValueError", "Tensor", "Tensor"], want
    for _epoch in range(2):
        got = outcomes(loader)  # the good batches held together
        assert_same_outcomes(got, want)
        assert "bad item 5" in str(got[0]) and "bad item 12000" in str(got[1])


# ------------------------------------------------------------------ timeout


@pytest.mark.timeout(60)
def test_timeout_raises_batch_timeout_error_instead_of_hanging(daemon: RunningDaemon, transport: str) -> None:
    loader = RemoteDataLoader("very-slow", batch_size=1, timeout=0.5, address=daemon.address, transport=transport)
    it = iter(loader)
    start = time.monotonic()
    with pytest.raises(loaderd.BatchTimeoutError) as error:
        next(it)
    elapsed = time.monotonic() - start
    it.close()
    assert isinstance(error.value, TimeoutError)
    # Each item takes 2 s: the error must come from the 0.5 s timeout, not from a late batch.
    assert 0.5 <= elapsed < 1.9, f"BatchTimeoutError after {elapsed:.2f}s"


# ------------------------------------------------------------------ early stop and vanishing clients


def assert_slow_starts_quickly(daemon: RunningDaemon, transport: str) -> None:
    """A new client's first batch is not stuck behind abandoned work (4 items of 50 ms on 2 workers)."""
    start = time.monotonic()
    it = iter(RemoteDataLoader("slow", batch_size=4, address=daemon.address, transport=transport))
    try:
        assert next(it).tolist() == [0, 1, 2, 3]
        elapsed = time.monotonic() - start
        assert elapsed < 2.0, f"first batch of a new client took {elapsed:.2f}s"
    finally:
        it.close()


@pytest.mark.timeout(60)
def test_break_out_of_epoch_cancels_the_stream(daemon: RunningDaemon, transport: str) -> None:
    """`for batch in loader: ... break` drops the iterator; as torch stops its workers, the stream is cancelled."""
    loader = RemoteDataLoader("slow", batch_size=4, address=daemon.address, transport=transport)
    before = receiver_threads()
    try:
        seen = []
        for i, batch in enumerate(loader):
            seen.append(batch)
            if i == 1:
                break
        assert [b.tolist() for b in seen] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        started = receiver_threads() - before
        assert len(started) == 1, "expected the epoch's receiver thread"
        gc.collect()
        assert_slow_starts_quickly(daemon, transport)
        # The abandoned epoch's gRPC call is cancelled, so its receiver thread ends
        # (the loader itself stays alive, as in a training loop that breaks early).
        wait_for(lambda: not any(t.is_alive() for t in started), 5.0, "the abandoned epoch's stream to be cancelled")
    finally:
        iter(loader).close()  # re-iterating closes a leftover epoch (cleanup only)


@pytest.mark.timeout(60)
def test_deleting_iterator_and_loader_cancels_the_stream(daemon: RunningDaemon, transport: str) -> None:
    loader = RemoteDataLoader("slow", batch_size=4, address=daemon.address, transport=transport)
    before = receiver_threads()
    it = iter(loader)
    leftover = weakref.ref(it)
    try:
        assert next(it).tolist() == [0, 1, 2, 3]
        assert next(it).tolist() == [4, 5, 6, 7]
        started = receiver_threads() - before
        assert len(started) == 1, "expected the epoch's receiver thread"
        del it, loader
        gc.collect()
        assert_slow_starts_quickly(daemon, transport)
        wait_for(lambda: not any(t.is_alive() for t in started), 5.0, "the deleted epoch's stream to be cancelled")
        assert leftover() is None, "the deleted iterator is still referenced"
        assert_serving(daemon)
    finally:
        alive = leftover()
        if alive is not None:
            alive.close()  # cleanup only
        del alive


def sigkill_client_after_first_line(script: str, daemon: RunningDaemon, transport: str, first_line: str) -> None:
    """Run a client script (argv: address, transport); once it printed ``first_line``, SIGKILL it."""
    with client_process(script, daemon.address, transport) as client:
        first = client.read_until(lambda line: True, 45, "the client printed nothing")[0]
        assert first.strip() == first_line, first
        client.sigkill()


CLIENT_SCRIPT = """
import sys
from loaderd import RemoteDataLoader
loader = RemoteDataLoader("slow", batch_size=4, address=sys.argv[1], transport=sys.argv[2])
for i, batch in enumerate(loader):
    print(i, batch.tolist(), flush=True)
print("done", flush=True)
"""


@pytest.mark.timeout(90)
def test_sigkilled_client_does_not_disturb_the_daemon(daemon: RunningDaemon, transport: str) -> None:
    sigkill_client_after_first_line(CLIENT_SCRIPT, daemon, transport, "0 [0, 1, 2, 3]")
    assert_serving(daemon)
    assert_squares_epoch(daemon, transport)
    assert_slow_starts_quickly(daemon, transport)
    assert_serving(daemon)


HOLDING_CLIENT_SCRIPT = """
import sys, time
from loaderd import RemoteDataLoader
loader = RemoteDataLoader("squares-big", batch_size=5120, address=sys.argv[1], transport=sys.argv[2])
held = []
for i, batch in enumerate(loader):
    held.append(batch)
    if i == 1:
        print("holding", len(held), int(held[0][1][-1]), int(held[1][1][-1]), flush=True)
        time.sleep(600)
"""


@pytest.mark.timeout(90)
def test_sigkilled_client_holding_large_batches(daemon: RunningDaemon, transport: str) -> None:
    """A client killed while it holds batches (slot leases on shm): the daemon takes them back."""
    released_before = daemon.log().count("slots; released")
    sigkill_client_after_first_line(HOLDING_CLIENT_SCRIPT, daemon, transport, "holding 2 5119 10239")
    if transport == "shm":
        wait_for(
            lambda: daemon.log().count("slots; released") > released_before,
            10.0,
            "the daemon to take back the killed client's slots",
        )
    assert_serving(daemon)
    want = list(DataLoader(datasets.Squares(SQUARES_BIG_N), batch_size=5120))
    for epoch in range(2):
        got = list(RemoteDataLoader("squares-big", batch_size=5120, address=daemon.address, transport=transport))
        assert_same_batches(got, want, f"epoch {epoch}")
    assert_squares_epoch(daemon, transport)
    assert_serving(daemon)


# ------------------------------------------------------------------ bad names and bad requests


@pytest.mark.timeout(60)
def test_unknown_dataset_raises_dataset_not_found(daemon: RunningDaemon) -> None:
    with pytest.raises(loaderd.DatasetNotFoundError) as error:
        RemoteDataLoader("no-such-dataset", batch_size=4, address=daemon.address)
    assert isinstance(error.value, LookupError)
    message = str(error.value)
    assert "no-such-dataset" in message and f"loaderd at {daemon.address}: " in message, message
    for name in DATASETS:
        assert name in message, f"{name!r} not listed in: {message}"
    with pytest.raises(loaderd.DatasetNotFoundError, match=r"did you mean 'squares'\?"):
        RemoteDataLoader("sqaures", batch_size=4, address=daemon.address)


def stream_call(address: str, requests: list[pb.StreamRequest]) -> list[pb.StreamResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = loaderd_pb2_grpc.LoaderStub(channel)
        return list(stub.StreamBatches(iter(requests), timeout=15))


def assert_rpc_fails(address: str, requests: list[pb.StreamRequest], code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as error:
        stream_call(address, requests)
    assert error.value.code() == code, f"{error.value.code()}: {error.value.details()}"
    return error.value.details()


@pytest.mark.timeout(60)
def test_malformed_requests_get_status_codes_and_daemon_keeps_serving(daemon: RunningDaemon, transport: str) -> None:
    plan = pb.StreamRequest(plan=pb.PlanBatches(batches=[pb.IndexBatch(indices=[0, 1])], end=True))

    # No open at all: the first message is a plan.
    details = assert_rpc_fails(daemon.address, [plan], grpc.StatusCode.INVALID_ARGUMENT)
    assert "open" in details, details

    # An empty request stream.
    assert_rpc_fails(daemon.address, [], grpc.StatusCode.INVALID_ARGUMENT)

    # An open for a dataset the config does not define.
    unknown = pb.StreamRequest(open=pb.OpenStream(protocol_revision=PROTOCOL_REVISION, dataset="no-such-dataset", auto_collation=True, window=4))
    details = assert_rpc_fails(daemon.address, [unknown, plan], grpc.StatusCode.NOT_FOUND)
    assert "no-such-dataset" in details and "squares" in details, details

    # A plan batch with zero indices.
    open_squares = pb.StreamRequest(open=pb.OpenStream(protocol_revision=PROTOCOL_REVISION, dataset="squares", auto_collation=True, window=4))
    empty = pb.StreamRequest(plan=pb.PlanBatches(batches=[pb.IndexBatch(indices=[])], end=True))
    details = assert_rpc_fails(daemon.address, [open_squares, empty], grpc.StatusCode.INVALID_ARGUMENT)
    assert "0 indices" in details, details

    # A well-formed raw stream still works, and so does the client library.
    responses = stream_call(daemon.address, [open_squares, plan])
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds[0] == "batch" and kinds[-1] == "end" and "error" not in kinds, kinds
    assert responses[-1].end.batches == 1
    assert_serving(daemon)
    assert_squares_epoch(daemon, transport)


# ------------------------------------------------------------------ dying workers (a daemon each)


DIED = re.compile(r"worker (\d+) died \(exit code (-?\d+)\); replacing it")


@pytest.mark.timeout(120)
def test_sigkilled_worker_is_replaced_and_epoch_completes_in_order(
    start_daemon: Callable[..., RunningDaemon], short_tmp: Path, transport: str
) -> None:
    marker = short_tmp / "killed-once"
    kill_once = {"dataset": "support.datasets:KillOnce", "kwargs": {"n": 60, "victim": 17, "marker": str(marker)}}
    daemon = start_daemon({"kill-once": kill_once}, workers=2)
    want = list(DataLoader(datasets.KillOnce(60, 17, ""), batch_size=4, shuffle=False))
    assert len(want) == 15

    loader = RemoteDataLoader("kill-once", batch_size=4, shuffle=False, address=daemon.address, transport=transport)
    got = list(loader)
    assert marker.exists(), "the victim index never ran: the test did not kill a worker"
    assert len(got) == len(want), f"{len(got)} batches, want {len(want)}: {[b.flatten().tolist() for b in got]}"
    assert_same_batches(got, want)

    # The daemon noticed the death and started a replacement.
    def replaced() -> bool:
        log = daemon.log()
        died = DIED.search(log)
        return bool(died) and re.search(rf"worker {died.group(1)} ready", log[died.end() :]) is not None

    wait_for(replaced, 30.0, "the daemon to log the dead worker and its replacement")
    died = DIED.search(daemon.log())
    assert died is not None and died.group(2) == str(-signal.SIGKILL), died
    assert len(DIED.findall(daemon.log())) == 1, daemon.log()

    # A later epoch works (on the replacement worker too).
    for epoch in range(2):
        assert_same_batches(list(loader), want, f"epoch {epoch + 2}")
    assert_serving(daemon)


@pytest.mark.timeout(120)
def test_batch_that_always_kills_its_worker_raises_worker_crashed_error(
    start_daemon: Callable[..., RunningDaemon], transport: str
) -> None:
    daemon = start_daemon(
        {"crash": {"dataset": "support.datasets:AlwaysCrash"}, "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 100}}},
        workers=2,
    )
    got = outcomes(RemoteDataLoader("crash", batch_size=1, address=daemon.address, transport=transport))
    assert len(got) == 10, got
    for i, outcome in enumerate(got):
        if i == 3:
            assert isinstance(outcome, loaderd.WorkerCrashedError), f"batch 3: {outcome!r}"
            assert "'crash'" in str(outcome), str(outcome)
        else:
            assert not isinstance(outcome, BaseException), f"batch {i} raised {outcome!r}"
            assert_same(outcome, torch.tensor([i]), f"batch {i}")
    assert DIED.search(daemon.log()), daemon.log()
    assert_serving(daemon)
    # The pool recovered: other datasets, and another epoch of this one, still work.
    assert_squares_epoch(daemon, transport)
    assert_serving(daemon)


@pytest.mark.timeout(120)
def test_sigkilled_worker_with_large_batches_in_flight(
    start_daemon: Callable[..., RunningDaemon], short_tmp: Path, transport: str
) -> None:
    """A worker dies while batches it wrote to shared-memory slots are leased to (held by) the client."""
    marker = short_tmp / "killed-once"
    n, victim = 6 * BIG_BATCH, 2 * BIG_BATCH + 500
    kill_once = {"dataset": "support.datasets:KillOnce", "kwargs": {"n": n, "victim": victim, "marker": str(marker)}}
    daemon = start_daemon({"kill-once-big": kill_once}, workers=2)
    want = list(DataLoader(datasets.KillOnce(n, victim, ""), batch_size=BIG_BATCH, shuffle=False))
    assert len(want) == 6

    loader = RemoteDataLoader(
        "kill-once-big", batch_size=BIG_BATCH, shuffle=False, address=daemon.address, transport=transport
    )
    got = list(loader)  # every batch held, those of the dead worker included
    assert marker.exists(), "the victim index never ran: the test did not kill a worker"
    assert_same_batches(got, want)
    wait_for(lambda: DIED.search(daemon.log()), 30.0, "the daemon to log the dead worker")
    assert len(DIED.findall(daemon.log())) == 1, daemon.log()

    # Later epochs, with the first one's batches still held and unchanged.
    for epoch in range(2):
        assert_same_batches(list(loader), want, f"epoch {epoch + 2}")
    assert_same_batches(got, want, "held")
    assert_serving(daemon)
