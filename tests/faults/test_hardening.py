"""Hardening (issue 9) against a real daemon: nothing a client or a dataset does wedges it,
starves the other tenants or loses their data. Each test is a case that broke the daemon before.
"""

from __future__ import annotations

import gc
import os
import resource
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import datasets
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, daemon_status, oracle_loader, popen_serve, running_daemon, wait_for, write_config
from support.processes import alive, cmdline, descendants

import loaderd
from loaderd import RemoteDataLoader
from loaderd.server.worker.worker import OOM_SCORE_ADJ_BOOST
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.v1 import loaderd_pb2_grpc
from loaderd.wire.limits import PROTOCOL_REVISION
from loaderd.wire.reasons import Reason, reason_of

BIG = 16384  # int64 items per batch: 128 KiB, so batches travel through shared-memory slots
DATASETS = {
    "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 64}},
    "ramp": {"dataset": "support.datasets:Squares", "kwargs": {"n": BIG * 40}},
    "blocks": {"dataset": "support.datasets:Blocks", "kwargs": {"n": 300}},
    "hang": {"dataset": "support.datasets:Hang", "kwargs": {"n": 12, "at": 5}, "task_timeout": 1.5},
    "exit": {"dataset": "support.datasets:ExitOn"},
    "shouty": {"dataset": "support.datasets:Shouty"},
    "deep": {"dataset": "support.datasets:Squares", "kwargs": {"n": 8}, "collate_fn": "support.datasets:deep_collate"},
    "stream": {"dataset": "support.datasets:Stream", "kwargs": {"n": 40}},
}
LIMITS = {"handshake_timeout": 1.0, "max_streams_per_client": 8, "max_replicas": 16}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="loaderd-hard-", workers=2, limits=LIMITS) as d:
        yield d


def stub(address: str) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(address)
    return channel, loaderd_pb2_grpc.LoaderStub(channel)


def raw_stream(address: str, requests: list[pb.StreamRequest], timeout: float = 10.0) -> grpc.RpcError:
    """Run a StreamBatches call to its end; the error it ended with (fails if it ended OK)."""
    channel, loader = stub(address)
    with channel:
        try:
            for _ in loader.StreamBatches(iter(requests), timeout=timeout):
                pass
        except grpc.RpcError as exc:
            return exc
    raise AssertionError("the call succeeded")


def healthy(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def squares_epoch_is_right(daemon: RunningDaemon, transport: str = "auto") -> None:
    got = list(RemoteDataLoader("squares", batch_size=8, address=daemon.address, transport=transport, timeout=30))
    assert_same_batches(got, list(oracle_loader(datasets.Squares(64), batch_size=8)))


def daemon_fds(daemon: RunningDaemon) -> int:
    return len(os.listdir(f"/proc/{daemon.process.pid}/fd"))


def daemon_threads(daemon: RunningDaemon) -> int:
    for line in Path(f"/proc/{daemon.process.pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line")


# ------------------------------------------------------------------ 1. the scheduler cannot be killed


@pytest.mark.timeout(60)
def test_a_position_past_uint64_is_refused_and_the_daemon_serves_on(daemon: RunningDaemon) -> None:
    opening = pb.StreamRequest(open=pb.OpenStream(protocol_revision=PROTOCOL_REVISION, dataset="exit", auto_collation=True, window=4, start=2**64 - 1))
    plan = pb.StreamRequest(plan=pb.PlanBatches(batches=[pb.IndexBatch(indices=[0]), pb.IndexBatch(indices=[3])]))
    error = raw_stream(daemon.address, [opening, plan])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "start" in error.details()
    assert healthy(daemon.address)
    squares_epoch_is_right(daemon)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("theirs", [0, PROTOCOL_REVISION - 1, PROTOCOL_REVISION + 1])
def test_a_client_of_another_protocol_revision_is_refused_naming_both(daemon: RunningDaemon, theirs: int) -> None:
    """Only the daemon's own revision is served, on a stream and on a session; the daemon serves on."""
    opening = pb.StreamRequest(open=pb.OpenStream(protocol_revision=theirs, dataset="squares", auto_collation=True, window=4))
    plan = pb.StreamRequest(plan=pb.PlanBatches(batches=[pb.IndexBatch(indices=[0])], end=True))
    error = raw_stream(daemon.address, [opening, plan])
    channel, loader = stub(daemon.address)
    with channel, pytest.raises(grpc.RpcError) as session_error:
        list(loader.Session(iter([pb.SessionRequest(hello=pb.SessionHello(pid=os.getpid(), protocol_revision=theirs))]), timeout=10))
    for refused in (error, session_error.value):
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and reason_of(refused) is Reason.REVISION_MISMATCH
        older = "an older" if theirs < PROTOCOL_REVISION else "a newer"
        assert f"the client runs {older} loaderd (protocol revision {theirs}; this daemon speaks revision {PROTOCOL_REVISION})" in (
            refused.details()
        )
    assert healthy(daemon.address)
    squares_epoch_is_right(daemon)


# ------------------------------------------------------------------ 2. file descriptors


@pytest.mark.timeout(120)
def test_batches_a_client_holds_cost_the_daemon_no_file_descriptors(daemon: RunningDaemon) -> None:
    # Issue 9.2: under `ulimit -n 256` a client keeping every 128 KiB batch wedged the daemon after ~231.
    soft, hard = resource.prlimit(daemon.process.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(daemon.process.pid, resource.RLIMIT_NOFILE, (256, hard))
    try:
        before = daemon_fds(daemon)
        loader = RemoteDataLoader("blocks", batch_size=None, address=daemon.address, transport="shm", timeout=30)
        kept = list(loader)  # every batch stays alive: the client holds 300 slots
        assert [int(b[0]) for b in kept] == list(range(300))
        assert daemon_fds(daemon) < before + 20, "the daemon's descriptors grew with the batches a client holds"
        del kept
    finally:
        resource.prlimit(daemon.process.pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert healthy(daemon.address)
    squares_epoch_is_right(daemon, "shm")


# ------------------------------------------------------------------ 3. hung __getitem__


@pytest.mark.timeout(90)
def test_a_hung_batch_times_out_its_worker_is_replaced_and_the_epoch_goes_on(daemon: RunningDaemon) -> None:
    restarts = sum(w.restarts for w in daemon_status(daemon.address).workers)
    outcomes: list[Any] = []
    iterator = iter(RemoteDataLoader("hang", batch_size=2, address=daemon.address, timeout=30))
    while True:
        try:
            outcomes.append(next(iterator))
        except StopIteration:
            break
        except loaderd.BatchTimeoutError as exc:
            outcomes.append(exc)
    errors = [o for o in outcomes if isinstance(o, Exception)]
    assert len(outcomes) == 6 and len(errors) == 1, outcomes
    assert outcomes.index(errors[0]) == 2, "batch 2 holds the hung item 5"
    message = str(errors[0])
    assert "'hang'" in message and "indices [4, 5]" in message and "task_timeout" in message, message
    assert [o.tolist() for o in outcomes if not isinstance(o, Exception)] == [[[0], [1]], [[2], [3]], [[6], [7]], [[8], [9]], [[10], [11]]]
    # The worker is out of the ready ones before its batch fails (the scheduler kills it first);
    # its replacement comes once the pool's poll sees the death.
    def whole_again() -> bool:
        workers = daemon_status(daemon.address).workers
        return all(w.ready for w in workers) and sum(w.restarts for w in workers) > restarts

    wait_for(whole_again, 30, "the hung worker's replacement to be ready")
    assert sum(w.restarts for w in daemon_status(daemon.address).workers) == restarts + 1
    squares_epoch_is_right(daemon)


# ------------------------------------------------------------------ 4. idle calls, admission


@pytest.mark.timeout(60)
def test_silent_calls_are_cut_and_never_block_health(daemon: RunningDaemon) -> None:
    channel, loader = stub(daemon.address)
    with channel:
        silent = [loader.StreamBatches(iter(lambda: time.sleep(30), 0), timeout=20) for _ in range(30)]
        silent += [loader.Session(iter(lambda: time.sleep(30), 0), timeout=20) for _ in range(10)]
        assert healthy(daemon.address)
        started = time.monotonic()
        for call in silent:
            with pytest.raises(grpc.RpcError) as cut:
                next(call)
            assert cut.value.code() == grpc.StatusCode.CANCELLED
        assert time.monotonic() - started < 10, "silent calls must be cut after limits.handshake_timeout"
    squares_epoch_is_right(daemon)


@pytest.mark.timeout(60)
def test_streams_per_client_are_capped_with_resource_exhausted(daemon: RunningDaemon) -> None:
    channel, loader = stub(daemon.address)
    opening = pb.StreamRequest(open=pb.OpenStream(protocol_revision=PROTOCOL_REVISION, dataset="squares", auto_collation=True, window=2))
    with channel:
        held = [loader.StreamBatches(iter([opening] + [None] * 0), timeout=30) for _ in range(8)]
        wait_for(lambda: len(daemon_status(daemon.address).streams) >= 8, 20, "8 streams open")
        error = raw_stream(daemon.address, [opening])
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams_per_client" in error.details()
        assert reason_of(error) is Reason.ADMISSION_LIMIT  # another daemon may take it (loaderd.wire.reasons)
        for call in held:
            call.cancel()
    wait_for(lambda: not daemon_status(daemon.address).streams, 20, "the held streams to close")
    with pytest.raises(loaderd.LimitExceededError, match="max_replicas"):
        next(iter(RemoteDataLoader("stream", num_workers=17, address=daemon.address)))


# ------------------------------------------------------------------ 5. a worker's exit loses nobody's batch


@pytest.mark.timeout(120)
def test_a_worker_leaving_through_python_keeps_other_tenants_batches(daemon: RunningDaemon) -> None:
    want = list(oracle_loader(datasets.Squares(BIG * 40), batch_size=BIG))
    got = []
    iterator = iter(RemoteDataLoader("ramp", batch_size=BIG, address=daemon.address, transport="shm", timeout=30, prefetch_factor=8, num_workers=2))
    got.append(next(iterator))  # the daemon now holds this tenant's next batches in slots
    exits = [o for o in iterate_outcomes(RemoteDataLoader("exit", batch_size=None, address=daemon.address, timeout=60))]
    assert any(isinstance(o, loaderd.WorkerCrashedError) for o in exits), exits
    got.extend(iterator)
    assert_same_batches(got, want)


def iterate_outcomes(loader: RemoteDataLoader) -> list[Any]:
    out: list[Any] = []
    iterator = iter(loader)
    while True:
        try:
            out.append(next(iterator))
        except StopIteration:
            return out
        except Exception as exc:
            out.append(exc)


# ------------------------------------------------------------------ 6. memory one client can claim


@pytest.mark.timeout(60)
def test_a_share_consumer_that_never_reads_does_not_make_the_pool_produce_its_plan(daemon: RunningDaemon) -> None:
    before = {d.info.name: d.batches_computed for d in daemon_status(daemon.address).datasets}["blocks"]
    opening = pb.StreamRequest(
        open=pb.OpenStream(protocol_revision=PROTOCOL_REVISION, dataset="blocks", auto_collation=True, window=2, share=pb.ShareSpec(name="lazy", fingerprint="f"))
    )
    plan = pb.StreamRequest(plan=pb.PlanBatches(batches=[pb.IndexBatch(indices=[i % 300]) for i in range(2000)]))
    channel, loader = stub(daemon.address)
    with channel:
        call = loader.StreamBatches(iter([opening, plan] + [None] * 0), timeout=30)
        computed = lambda: {d.info.name: d.batches_computed for d in daemon_status(daemon.address).datasets}["blocks"] - before  # noqa: E731 - a one-line probe, read where it is used
        wait_for(lambda: computed() >= 2, 20, "the window to be produced")
        # The window is 2; gRPC's flow control lets the transport absorb a few MiB the
        # client never reads (a few dozen 128 KiB batches). The pool, free, would run
        # the whole 2,000-batch plan in about a second (it did, before): give it two.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert computed() <= 100
        call.cancel()


# ------------------------------------------------------------------ 7. oversized and echoed data


@pytest.mark.timeout(60)
def test_huge_names_errors_and_structures_stay_bounded(daemon: RunningDaemon) -> None:
    opening = pb.StreamRequest(open=pb.OpenStream(protocol_revision=PROTOCOL_REVISION, dataset="squares", auto_collation=True, client="n" * 10_000_000))
    error = raw_stream(daemon.address, [opening])
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and len(error.details()) < 300
    assert reason_of(error) is Reason.REQUEST_LIMIT  # every daemon would refuse it alike
    assert daemon_status(daemon.address).version
    outcomes = iterate_outcomes(RemoteDataLoader("shouty", batch_size=None, address=daemon.address, timeout=30))
    assert len(outcomes) == 8
    shouts = [o for o in outcomes[1::2]]
    assert all(isinstance(o, ValueError) for o in shouts), [type(o) for o in shouts]
    assert all(len(str(o)) < 50_000 and "__getitem__" in str(o) for o in shouts), "bounded, frames kept"
    assert isinstance(outcomes[2], loaderd.TransportError) and "structure" in str(outcomes[2])
    assert [o.item() for o in outcomes[0::2] if isinstance(o, torch.Tensor)] == [0, 4, 6]
    assert os.path.getsize(daemon.log_path) < 2_000_000, "user error texts are echoed into the log unbounded"


@pytest.mark.timeout(60)
def test_an_encode_error_fails_its_batch_not_the_worker(daemon: RunningDaemon) -> None:
    restarts = sum(w.restarts for w in daemon_status(daemon.address).workers)
    outcomes = iterate_outcomes(RemoteDataLoader("deep", batch_size=1, address=daemon.address, timeout=30))
    assert isinstance(outcomes[1], loaderd.TransportError) and "RecursionError" in str(outcomes[1]), outcomes[1]
    assert [o[1].tolist() for i, o in enumerate(outcomes) if i != 1] == [[0], [2], [3], [4], [5], [6], [7]]
    assert sum(w.restarts for w in daemon_status(daemon.address).workers) == restarts


# ------------------------------------------------------------------ 8. garbage bytes


@pytest.mark.timeout(60)
def test_garbage_request_bytes_are_invalid_arguments(daemon: RunningDaemon) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        for method in ("ListDatasets", "DescribeDataset", "Status"):
            call = channel.unary_unary(f"/loaderd.v1.Loader/{method}")
            with pytest.raises(grpc.RpcError) as failed:
                call(b"\xff\xff\xff\xff", timeout=5)
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, failed.value)
        streaming = channel.stream_stream("/loaderd.v1.Loader/StreamBatches")
        with pytest.raises(grpc.RpcError) as failed:
            list(streaming(iter([b"\xff\xff\xff"]), timeout=5))
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ------------------------------------------------------------------ 9. smaller things


@pytest.mark.timeout(60)
def test_a_dataset_whose_len_raises_stops_serve_naming_it(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"counted": {"dataset": "support.datasets:LenFails"}}, listen=[f"unix://{tmp_path}/d.sock"])
    process = popen_serve(config, tmp_path / "log")
    assert process.wait(60) == 1
    log = (tmp_path / "log").read_text()
    assert "dataset 'counted': len() raised ValueError: cannot count my items" in log, log
    assert "Traceback" not in log, log


@pytest.mark.timeout(90)
def test_sigterm_returns_after_every_process_of_the_daemon_has_exited() -> None:
    with running_daemon({"squares": DATASETS["squares"]}, prefix="loaderd-term-", expect_running=False) as d:
        processes = {p: cmdline(p) for p in descendants(d.process.pid)}
        assert any("forkserver" in command for command in processes.values()), processes
        assert d.stop(signal.SIGTERM) == 0
        # multiprocessing's resource tracker exits on its own once the daemon's end of its pipe closes.
        left = {p.pid: c for p, c in processes.items() if alive(p) and "resource_tracker" not in c}
        assert left == {}, f"processes outlived the daemon: {left}"
        wait_for(lambda: not any(alive(p) for p in processes), 10, "the resource tracker to exit")


@pytest.mark.timeout(90)
def test_workers_are_recycled_after_max_tasks_per_worker() -> None:
    with running_daemon({"squares": DATASETS["squares"]}, prefix="loaderd-recycle-", max_tasks_per_worker=5) as d:
        got = list(RemoteDataLoader("squares", batch_size=2, address=d.address, timeout=30))
        assert_same_batches(got, list(oracle_loader(datasets.Squares(64), batch_size=2)))
        wait_for(lambda: sum(w.restarts for w in daemon_status(d.address).workers) >= 4, 30, "workers to be recycled")
        assert "recycling worker" in d.log() and "died" not in d.log()


@pytest.mark.timeout(90)
def test_a_replacement_worker_that_hangs_while_building_is_killed_and_replaced(tmp_path: Path) -> None:
    """Before, only the pool's first start had a deadline: a replacement whose constructor hung held its slot for good."""
    marker = tmp_path / "hang"
    squares = {"dataset": "support.datasets:HangIfMarked", "kwargs": {"n": 64, "marker": str(marker)}}
    with running_daemon({"squares": squares}, prefix="loaderd-hangstart-", serve_args=("--startup-timeout", "8")) as d:
        marker.touch()  # the next worker to start hangs in the constructor (and takes the marker)
        os.kill(next(w.pid for w in daemon_status(d.address).workers if w.worker_id == 0), signal.SIGKILL)
        wait_for(lambda: "replacement worker 0 did not build its datasets within 8s" in d.log(), 40, "the hung replacement to be killed")
        wait_for(lambda: all(w.ready for w in daemon_status(d.address).workers), 30, "the next replacement to be ready")
        assert [w.restarts for w in daemon_status(d.address).workers] == [2, 0], d.log()
        squares_epoch_is_right(d)


@pytest.mark.timeout(120)
def test_an_iterable_is_served_by_the_other_workers_once_a_slot_is_given_up(tmp_path: Path) -> None:
    """Before, its replicas stayed pinned to the given-up slot: with num_workers >= the pool size every
    stream had one there and failed UNAVAILABLE (earlier still, it waited for ever)."""
    marker = tmp_path / "fail"
    stream = {"dataset": "support.datasets:stream_unless_marked", "kwargs": {"n": 40, "marker": str(marker)}}
    with running_daemon({"stream": stream}, prefix="loaderd-givenup-") as d:
        marker.touch()  # from now on, a worker that starts fails to build the dataset
        os.kill(next(w.pid for w in daemon_status(d.address).workers if w.worker_id == 0), signal.SIGKILL)
        wait_for(lambda: "giving up on worker slot 0" in d.log(), 60, "worker slot 0 to be given up")
        got = list(RemoteDataLoader("stream", batch_size=4, num_workers=2, address=d.address, timeout=30))
        assert_same_batches(got, list(oracle_loader(datasets.Stream(40), batch_size=4, num_workers=2)))


@pytest.mark.timeout(30)
def test_the_oom_killer_would_take_a_pool_worker_before_the_fork_server_or_the_daemon(daemon: RunningDaemon) -> None:
    def adj(pid: int) -> int:
        return int(Path(f"/proc/{pid}/oom_score_adj").read_text())

    workers = [w.pid for w in daemon_status(daemon.address).workers]
    fork_servers = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in workers}
    assert len(fork_servers) == 1 and daemon.process.pid not in fork_servers, "workers are the fork server's children"
    (fork_server,) = fork_servers
    assert adj(fork_server) == adj(daemon.process.pid)
    assert [adj(pid) for pid in workers] == [min(1000, adj(fork_server) + OOM_SCORE_ADJ_BOOST)] * len(workers)


@pytest.mark.timeout(90)
def test_an_idle_pool_gives_its_shared_memory_back(daemon: RunningDaemon) -> None:
    kept = list(RemoteDataLoader("blocks", batch_size=None, address=daemon.address, transport="shm", timeout=30))
    prefix = f"loaderd-{daemon.process.pid}-"
    # Segments only: not the session probes, nor the daemon's direct socket (server/rpc/direct_listener.py).
    segments = lambda: [n for n in os.listdir("/dev/shm") if n.startswith(prefix) and "probe" not in n and not n.endswith("-direct")]  # noqa: E731 - a one-line probe, read where it is used
    assert segments(), "the epoch left no segment to give back: the test is broken"
    del kept
    # After tests/faults/test_failover.py in the same process, a batch of this epoch stayed referenced
    # until the collector ran (a client-side reference cycle, not pinned down yet: see issue 10's
    # note). This test is about the daemon giving memory back once the client lets go.
    gc.collect()
    wait_for(lambda: not segments(), 60, "idle workers to remove their segments")
    squares_epoch_is_right(daemon, "shm")
