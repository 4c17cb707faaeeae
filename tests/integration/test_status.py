"""Seeing inside the daemon: `loaderd status`, the Prometheus endpoint, gRPC reflection."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.core import CounterMetricFamily
from support.compare import assert_same_batches
from support.daemons import (
    STARTUP_TIMEOUT_S,
    RunningDaemon,
    Samples,
    daemon_status,
    loaderd_cli,
    metrics_url,
    popen_serve,
    running_daemon,
    scrape,
    wait_for,
    wait_serving,
    write_config,
)
from support.datasets import Squares
from torch.utils.data import DataLoader

from loaderd import RemoteDataLoader
from loaderd.epoch.window import MAP_PREFETCH
from loaderd.server.ops.metrics import CACHE_METRICS
from loaderd.server.ops.status import ClientRate, client_rates
from loaderd.server.scheduling.client_tally import KEEP_S, ClientTally, StreamUse
from loaderd.stream.lane import client_name
from loaderd.v1 import loaderd_pb2 as pb

N = 100
BATCH = 4
EPOCH = N // BATCH
DATASETS = {"squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": N}}}
# A CLI run pays Python's and torch's import.


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    """One daemon (2 workers, metrics on a free port) for the tests that kill nothing."""
    with running_daemon(DATASETS, prefix="ld-status-", metrics={"port": 0}) as running:
        yield running


# ------------------------------------------------------------------ helpers



def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def client_series(samples: Samples, per_stream: bool = True) -> dict[str, dict[str, str]]:
    """This process's per-stream series (or, ``per_stream=False``, its per-client ones): metric name -> labels."""
    series = {name: dict(labels) for name, labels in samples if name.startswith("loaderd_client_")}
    return {
        name: labels
        for name, labels in series.items()
        if labels.get("client") == client_name() and ("stream" in labels) == per_stream
    }


def is_descendant(pid: int, ancestor: int) -> bool:
    """Whether ``ancestor`` is among ``pid``'s parents (so the test kills only its own daemon's workers)."""
    while pid > 1:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return False
        pid = int(fields[1])
        if pid == ancestor:
            return True
    return False


# ------------------------------------------------------------------ loaderd status


@pytest.mark.timeout(120)
def my_batches(address: str) -> int:
    """The batches the daemon sent this process from 'squares' (the CLIENT table), over all its streams."""
    return sum(c.batches for c in daemon_status(address).clients if c.client == client_name() and c.dataset == "squares")


def test_status_shows_a_stream_mid_epoch(daemon: RunningDaemon) -> None:
    before = my_batches(daemon.address)
    loader = RemoteDataLoader("squares", batch_size=BATCH, address=daemon.address)
    it = iter(loader)
    first = [next(it) for _ in range(3)]

    result = loaderd_cli("status", "--address", daemon.address, "--json")
    assert result.returncode == 0, result.stderr
    snapshot = json.loads(result.stdout)
    assert snapshot["sessions"] >= 1 and snapshot["uptime_s"] > 0 and snapshot["version"]
    assert [(w["worker_id"], w["alive"], w["ready"]) for w in snapshot["workers"]] == [(0, True, True), (1, True, True)]
    assert all(w["pid"] > 0 for w in snapshot["workers"])
    (dataset,) = snapshot["datasets"]
    assert dataset["info"] == {"name": "squares", "kind": "MAP", "has_length": True, "length": N}
    assert dataset["open_streams"] == 1 and dataset["batches_computed"] >= 3 and dataset["batches_delivered"] >= 3
    (stream,) = [s for s in snapshot["streams"] if s["client"] == client_name()]
    assert stream["dataset"] == "squares"
    assert stream["window"] == 2 * MAP_PREFETCH  # the default, 8 a pool worker x 2
    assert stream["delivered"] >= 3
    assert stream["open_s"] > 0 and stream["share"] == ""

    table = loaderd_cli("status", "--address", daemon.address)
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith("loaderd ") and "WORKER" in table.stdout and "DATASET" in table.stdout
    (row,) = [line.split() for line in table.stdout.splitlines() if client_name() in line and line.split()[0].isdigit()]
    (client_row,) = [line.split() for line in table.stdout.splitlines() if line.startswith(client_name())]
    assert client_row[:4] == [client_name(), "-", "squares", "1"], client_row  # CLIENT IDENTITY DATASET STREAMS
    assert row[0] == str(stream["stream_id"]) and "squares" in row and str(stream["window"]) in row

    rest = list(it)
    assert len(first) + len(rest) == EPOCH
    assert re.search(rf"stream {stream['stream_id']} opened by {re.escape(repr(client_name()))} ", daemon.log())
    wait_for(lambda: not daemon_status(daemon.address).streams, 20.0, "the finished stream to leave the status")
    assert my_batches(daemon.address) - before == EPOCH  # batches sent to it, the epoch's last ones included


def my_stream(address: str) -> Any:
    """This process's one open stream of 'squares' in the daemon's status (None: none is open)."""
    mine = [s for s in daemon_status(address).streams if s.client == client_name() and s.dataset == "squares"]
    assert len(mine) <= 1, mine
    return mine[0] if mine else None


@pytest.mark.timeout(60)
def test_consumed_counts_what_the_caller_took_of_an_epoch_that_arrived_whole(daemon: RunningDaemon) -> None:
    """The whole epoch fits in the stream's window, so every batch arrives before the caller takes
    any and no plan message follows: CONSUMED still follows the caller (issue 38)."""
    batch_size, taken = 16, 3
    loader = RemoteDataLoader("squares", batch_size=batch_size, address=daemon.address)
    length = len(loader)
    assert length == -(-N // batch_size) <= 2 * MAP_PREFETCH, "the epoch fits in the window (the default, 8 a pool worker x 2)"
    it = iter(loader)
    got = [next(it) for _ in range(taken)]
    wait_for(lambda: (s := my_stream(daemon.address)) is not None and s.delivered == length, 20.0, "the whole epoch to be sent")
    wait_for(lambda: my_stream(daemon.address).consumed == taken, 20.0, f"CONSUMED to reach {taken}")
    table = loaderd_cli("status", "--address", daemon.address)
    assert table.returncode == 0, table.stderr
    header, row = [line.split() for line in table.stdout.splitlines() if line.startswith("STREAM ") or client_name() in line.split()[1:2]]
    assert row[header.index("CONSUMED")] == str(taken) and row[header.index("DELIVERED")] == str(length), table.stdout

    got += [next(it) for _ in range(length - taken)]  # every batch taken; the next next() ends the epoch
    wait_for(lambda: my_stream(daemon.address).consumed == length, 20.0, f"CONSUMED to reach {length}")
    with pytest.raises(StopIteration):
        next(it)
    assert_same_batches(got, list(DataLoader(Squares(N), batch_size=batch_size)))
    wait_for(lambda: my_stream(daemon.address) is None, 20.0, "the finished stream to leave the status")


def test_client_rates_over_an_interval_or_over_the_time_its_streams_were_open() -> None:
    def snapshot(*clients: tuple[str, int, int, float, float]) -> pb.StatusResponse:
        return pb.StatusResponse(
            clients=[pb.ClientStatus(client=c, dataset="d", open_streams=o, batches=b, waited_s=w, active_s=a) for c, o, b, w, a in clients]
        )

    first = snapshot(("a", 1, 10, 1.0, 2.0))
    assert client_rates(None, first, 0.0) == {("a", "d"): ClientRate(batches_s=5.0, waiting=0.5)}  # over its open time
    second = snapshot(("a", 1, 40, 1.5, 4.0), ("b", 0, 3, 0.0, 1.0))
    assert client_rates(first, second, 2.0) == {("a", "d"): ClientRate(15.0, 0.25), ("b", "d"): ClientRate(3.0, 0.0)}  # b is new
    idle = snapshot(("a", 0, 40, 1.5, 4.0), ("b", 0, 3, 0.0, 1.0))
    assert client_rates(idle, idle, 2.0)[("a", "d")] == ClientRate(0.0, 0.0)  # no stream open in the interval
    assert client_rates(second, snapshot(("a", 1, 40, 9.0, 5.0)), 1.0)[("a", "d")].waiting == 1.0  # clamped


def test_client_tally_spans_streams_and_forgets_old_clients() -> None:
    tally = ClientTally()
    tally.closed(StreamUse("vm:1", "", "d", batches=10, waited_s=1.0, active_s=2.0), now=100.0, open_keys=())
    tally.closed(StreamUse("vm:1", "", "d", batches=5, waited_s=0.5, active_s=1.0), now=101.0, open_keys=())
    running = StreamUse("vm:1", "", "d", batches=2, waited_s=0.0, active_s=0.5)
    (row,) = tally.rows([running], now=102.0)
    assert (row.client, row.open_streams, row.batches, row.waited_s, row.active_s) == ("vm:1", 1, 17, 1.5, 3.5)
    # A long epoch: its client is not forgotten while the stream is open (its counters never go back).
    (row,) = tally.rows([running], now=101.0 + 2 * KEEP_S)
    assert row.batches == 17
    tally.closed(StreamUse("vm:2", "", "d", batches=1, waited_s=0.0, active_s=1.0), now=101.0 + 2 * KEEP_S, open_keys=[("vm:1", "d")])
    assert {r.client for r in tally.rows([running], now=101.0 + 2 * KEEP_S)} == {"vm:1", "vm:2"}
    assert [r.client for r in tally.rows([], now=102.0 + 3 * KEEP_S)] == []  # idle KEEP_S after their last close


@pytest.mark.timeout(120)
def test_watch_tells_a_starved_trainer_from_one_the_data_keeps_up_with(start_daemon: Callable[..., RunningDaemon]) -> None:
    # "starved": items take 0.1 s and the trainer takes each batch at once, so it mostly waits.
    # "keeps up": instant items, a trainer that spends 0.1 s per batch (it needs 10 batches/s; the pool
    # makes ~20/s for it beside the slow stream), so it hardly waits.
    daemon = start_daemon(
        {
            "slow": {"dataset": "support.datasets:Slow", "kwargs": {"n": 5000, "delay": 0.1}},
            "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 5000}},
        }
    )
    stop = threading.Event()

    def train(name: str, step_s: float) -> None:
        it = iter(RemoteDataLoader(name, batch_size=1, address=daemon.address))
        while not stop.is_set():
            next(it)
            time.sleep(step_s)
        it.close()

    trainers = [threading.Thread(target=train, args=a, daemon=True) for a in (("slow", 0.0), ("squares", 0.1))]
    for t in trainers:
        t.start()
    try:
        result = loaderd_cli("status", "--address", daemon.address, "--watch", "--json", "--interval", "2", "--count", "3")
    finally:
        stop.set()
        for t in trainers:
            t.join(30)
    assert result.returncode == 0, result.stderr
    snapshots = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(snapshots) == 3, result.stdout
    mine = [c for c in snapshots[-1]["clients"] if c["client"] == client_name()]
    last = {c["dataset"]: c for c in mine}  # rates over the last 2 s
    assert last["slow"]["waiting"] > 0.6 and 5 <= last["slow"]["batches_s"] <= 25, last["slow"]
    # ~10 batches/s; the client reports what it took with its next plan message, so 2 s windows jitter.
    assert last["squares"]["waiting"] < 0.35 and 5 <= last["squares"]["batches_s"] <= 15, last["squares"]


@pytest.mark.timeout(120)
def test_status_of_an_unreachable_daemon_exits_1(short_tmp: Path) -> None:
    address = f"unix://{short_tmp}/nobody.sock"
    result = loaderd_cli("status", "--address", address, "--timeout", "5")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(f"loaderd: cannot get status from {address}: UNAVAILABLE: no socket file at {short_tmp}/nobody.sock. Is `loaderd serve"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# ------------------------------------------------------------------ metrics


@pytest.mark.timeout(120)
def test_metrics_count_an_epoch(daemon: RunningDaemon) -> None:
    url = metrics_url(daemon.log())
    before = scrape(url)
    assert len(list(RemoteDataLoader("squares", batch_size=BATCH, address=daemon.address))) == EPOCH
    after = scrape(url)

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert grew("loaderd_batches_computed_total", dataset="squares") == EPOCH
    assert grew("loaderd_batches_delivered_total", dataset="squares") == EPOCH
    assert grew("loaderd_samples_fetched_total", dataset="squares") == N
    assert grew("loaderd_batch_errors_total", dataset="squares") == 0
    assert grew("loaderd_batch_latency_seconds_count", dataset="squares") == EPOCH
    assert grew("loaderd_batch_latency_seconds_sum", dataset="squares") > 0
    count = sample(after, "loaderd_batch_latency_seconds_count", dataset="squares")
    assert sample(after, "loaderd_batch_latency_seconds_bucket", dataset="squares", le="+Inf") == count
    assert sample(after, "loaderd_workers") == sample(after, "loaderd_workers_alive") == 2
    assert sample(after, "loaderd_worker_restarts_total") == 0
    # What the endpoint says agrees with `loaderd status`.
    (dataset,) = daemon_status(daemon.address).datasets
    assert dataset.batches_computed == sample(after, "loaderd_batches_computed_total", dataset="squares")


@pytest.mark.timeout(120)
def test_metrics_have_per_client_series_while_a_stream_is_open(daemon: RunningDaemon) -> None:
    url = metrics_url(daemon.log())
    it = iter(RemoteDataLoader("squares", batch_size=BATCH, address=daemon.address))
    for _ in range(3):  # the client reports what it took with its next plans: some of it has arrived by now
        next(it)
    (stream,) = [s for s in daemon_status(daemon.address).streams if s.client == client_name()]
    samples = scrape(url)
    labels = {"client": client_name(), "identity": "", "stream": str(stream.stream_id), "dataset": "squares"}
    assert client_series(samples) == {
        "loaderd_client_batches_delivered_total": labels,
        "loaderd_client_stall_seconds_total": labels,
        "loaderd_client_in_flight": labels,
    }
    assert sample(samples, "loaderd_client_batches_delivered_total", **labels) >= 1
    assert sample(samples, "loaderd_open_streams", dataset="squares") == 1
    # The client's own series span its streams (epochs): no stream label.
    mine = {"client": client_name(), "identity": "", "dataset": "squares"}
    assert client_series(samples, per_stream=False) == {
        "loaderd_client_batches_total": mine,
        "loaderd_client_waited_seconds_total": mine,
        "loaderd_client_active_seconds_total": mine,
    }

    del it  # stopping early cancels the stream: its series go with it, the client's stay
    gc.collect()
    wait_for(lambda: not client_series(scrape(url)), 20.0, "the closed stream's series to disappear")
    after = scrape(url)
    assert sample(after, "loaderd_open_streams", dataset="squares") == 0
    assert sample(after, "loaderd_client_batches_total", **mine) >= 1 and sample(after, "loaderd_client_active_seconds_total", **mine) > 0


@pytest.mark.timeout(120)
def test_metrics_port_option_and_bind_failure(short_tmp: Path) -> None:
    config = write_config(short_tmp, DATASETS, workers=1, listen=[f"unix://{short_tmp}/d.sock"])
    log_path = short_tmp / "daemon.log"
    process = popen_serve(config, log_path, "--metrics-port", "0")
    try:
        wait_serving(f"unix://{short_tmp}/d.sock", process, log_path, STARTUP_TIMEOUT_S)
        url = metrics_url(log_path.read_text())
        assert url.startswith("http://127.0.0.1:")  # the default host
        assert sample(scrape(url), "loaderd_workers") == 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0, log_path.read_text()
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url, timeout=5.0)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)

    # A port already taken: the daemon says so in one line and exits 1.
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        process = popen_serve(config, log_path, "--metrics-port", str(port))
        try:
            assert process.wait(STARTUP_TIMEOUT_S) == 1
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    last = log_path.read_text().strip().splitlines()[-1]
    assert last.startswith(f"loaderd: cannot start: cannot serve metrics on 127.0.0.1:{port}: "), last
    assert "workers ready" not in log_path.read_text(), "refused only after building the pool"


# ------------------------------------------------------------------ worker restarts


@pytest.mark.timeout(120)
def test_killed_worker_shows_as_a_restart(start_daemon: Callable[..., RunningDaemon]) -> None:
    daemon = start_daemon(DATASETS, workers=2, metrics={"port": 0})
    url = metrics_url(daemon.log())
    victim = daemon_status(daemon.address).workers[0]
    assert victim.alive and victim.restarts == 0
    assert is_descendant(victim.pid, daemon.process.pid), "status names a pid that is not this daemon's worker"
    os.kill(victim.pid, signal.SIGKILL)

    def replaced() -> pb.WorkerStatus | None:
        worker = daemon_status(daemon.address).workers[0]
        return worker if worker.restarts == 1 and worker.ready and worker.alive else None

    worker = wait_for(replaced, 30.0, "status to show worker 0 replaced")
    assert worker.pid != victim.pid
    assert daemon_status(daemon.address).workers[1].restarts == 0
    samples = scrape(url)
    assert sample(samples, "loaderd_worker_restarts_total") == 1
    assert sample(samples, "loaderd_workers_alive") == 2
    assert re.search(rf"worker 0 died \(exit code {-signal.SIGKILL}\)", daemon.log()), daemon.log()
    # The replacement serves.
    assert len(list(RemoteDataLoader("squares", batch_size=BATCH, address=daemon.address))) == EPOCH


# ------------------------------------------------------------------ reflection


@pytest.mark.timeout(60)
def test_reflection_lists_services_and_resolves_methods(daemon: RunningDaemon) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert set(database.get_services()) == {
            "loaderd.v1.Loader",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        }
        service = DescriptorPool(database).FindServiceByName("loaderd.v1.Loader")
        methods = {m.name: (m.input_type.full_name, m.output_type.full_name) for m in service.methods}
    assert methods["Status"] == ("loaderd.v1.StatusRequest", "loaderd.v1.StatusResponse")
    assert set(methods) == {"ListDatasets", "DescribeDataset", "StreamBatches", "Session", "Status"}
    assert service.methods_by_name["StreamBatches"].client_streaming


@pytest.mark.timeout(120)
def test_grafana_dashboard_queries_only_metrics_the_daemon_exports(daemon: RunningDaemon) -> None:
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "loaderd.json").read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels) and all(p["targets"] for p in panels)
    used = {name for p in panels for t in p["targets"] for name in re.findall(r"\bloaderd_\w+", t["expr"])}
    assert "loaderd_client_waited_seconds_total" in used and "loaderd_batch_latency_seconds_bucket" in used
    it = iter(RemoteDataLoader("squares", batch_size=BATCH, address=daemon.address))
    next(it)  # an open stream and a finished batch: every family has samples
    exported = {name for name, _ in scrape(metrics_url(daemon.log()))}
    it.close()
    # The item cache's families have samples only for a dataset with a cache: (this daemon's has none);
    # tests/integration/test_item_cache.py scrapes them from one. Here: their names are the exported ones.
    cache = {name for name in used if name.startswith("loaderd_cache_")}
    assert used - cache <= exported, f"the dashboard queries metrics the daemon does not export: {sorted(used - cache - exported)}"
    declared = {f"{name}_total" if kind is CounterMetricFamily else name for name, _, kind, _ in CACHE_METRICS}
    assert cache and cache <= declared, f"the dashboard queries cache metrics the daemon does not export: {sorted(cache - declared)}"


@pytest.mark.timeout(30)
def test_watch_says_an_unreachable_daemon_once_not_every_interval(tmp_path: Path) -> None:
    """--watch keeps retrying a daemon that is not there, saying so once (not the hint every interval)."""
    command = [sys.executable, "-m", "loaderd.server.app.cli", "status", "--watch", "--interval", "0.1", "--address", f"unix://{tmp_path}/none.sock"]
    watcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        first = watcher.stderr.readline() if watcher.stderr is not None else ""
        assert "cannot get status from" in first and "(retrying every 0.1s)" in first, first
        time.sleep(1.5)  # ~15 more tries, none said again
    finally:
        watcher.terminate()
        _, rest = watcher.communicate(timeout=10)
    assert "cannot get status" not in rest, rest
