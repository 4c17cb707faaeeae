"""Fixtures and helpers that start a real `loaderd serve` and wait for it to be SERVING."""

from __future__ import annotations

import contextlib
import multiprocessing
import platform
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch.utils.data import DataLoader

TESTS_DIR = Path(__file__).resolve().parents[1]
# Tests of what glibc's malloc does (page faults, thresholds) skip elsewhere.
glibc_malloc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's malloc"
)
STARTUP_TIMEOUT_S = 60.0


@dataclass
class RunningDaemon:
    """A `loaderd serve` subprocess and where to reach it."""

    process: subprocess.Popen[str]
    address: str
    socket_path: Path
    config_path: Path
    log_path: Path
    extra_addresses: list[str] = field(default_factory=list)

    def log(self, since: int = 0) -> str:
        """The daemon's log from byte ``since`` on (a ``log_path.stat().st_size`` taken earlier). Bytes that
        do not decode are replaced: a dataset may print anything, and a test's message must still come out."""
        return self.log_path.read_bytes()[since:].decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal the daemon and wait for it to exit; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
            raise AssertionError(f"daemon did not exit within {timeout}s after {sig}:\n{self.log()}") from None


FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 100),
]


def wait_serving(address: str, process: subprocess.Popen[str] | None, log_path: Path | None, timeout: float) -> None:
    """Poll the standard health service until SERVING (never sleep-and-hope)."""
    deadline = time.monotonic() + timeout
    # Reconnect at once when the socket appears: gRPC's default backoff (1 s, growing) would add a
    # second or more to every daemon start whose first connect came before the daemon listened.
    with grpc.insecure_channel(address, options=FAST_RECONNECT) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                log = log_path.read_text() if log_path else ""
                raise AssertionError(f"daemon exited with {process.returncode} before serving:\n{log}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise AssertionError(f"daemon at {address} not SERVING within {timeout}s")


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.05) -> Any:
    """Poll ``predicate`` every ``poll`` s until it returns something true (returned); fails after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def ends_on_its_own_thread(target: Callable[[], None], timeout: float, what: str) -> None:
    """Run ``target`` on a daemon thread and fail with ``what`` if it has not ended within ``timeout`` s:
    for code that may deadlock its own thread, so that the test fails instead of hanging."""
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), what


def daemon_status(address: str) -> Any:
    """The daemon's Status RPC reply (a loaderd.v1.StatusResponse)."""
    from loaderd.v1 import loaderd_pb2 as pb
    from loaderd.v1 import loaderd_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return loaderd_pb2_grpc.LoaderStub(channel).Status(pb.StatusRequest(), timeout=10.0)


def oracle_loader(dataset: Any, **kwargs: Any) -> DataLoader:
    """torch's DataLoader as the oracle. Its worker processes come from a fork server:
    forking this process, which runs gRPC threads, can deadlock the forked worker."""
    if kwargs.get("num_workers", 0) > 0:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "support.datasets"])  # workers start in milliseconds, not seconds
        kwargs["multiprocessing_context"] = context
    return DataLoader(dataset, **kwargs)


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """Every tensor in a batch, depth first."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for item in batch.values() for t in tensors_of(item)]
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in tensors_of(item)]
    return []


def write_config(directory: Path, datasets: dict[str, Any], **top: Any) -> Path:
    # A short drain: a test that still holds an iterator must not make every SIGTERM'd daemon wait 30 s.
    config = {"python_path": [str(TESTS_DIR)], "datasets": datasets, "drain_timeout": 2, **top}
    path = directory / "ds.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def serve_command(config_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "loaderd.server.app.cli", "serve", "--config", str(config_path), *extra]


def loaderd_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``loaderd ARGS...`` to completion (stdin closed); its exit code and output."""
    command = [sys.executable, "-m", "loaderd.server.app.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def popen_serve(config_path: Path, log_path: Path, *extra: str) -> subprocess.Popen[str]:
    """Start `loaderd serve` with its stdout and stderr going to ``log_path``."""
    with open(log_path, "w") as log_file:
        command = serve_command(config_path, *extra)
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, text=True)


@contextlib.contextmanager
def running_daemon(
    datasets: dict[str, Any],
    *,
    prefix: str,
    workers: int | str | dict[str, int] = 2,
    tcp: bool = False,
    socket_path: Path | None = None,
    expect_running: bool = True,
    serve_args: tuple[str, ...] = (),
    **top: Any,
) -> Iterator[RunningDaemon]:
    """A `loaderd serve` on a unix socket (and 127.0.0.1:0 with ``tcp``), SERVING when yielded.

    Config and log live in a fresh temp dir named ``prefix``...; the socket too,
    unless ``socket_path`` is given. ``serve_args`` go to `loaderd serve`; ``top`` adds top-level config keys. When the
    block ends without an exception the daemon must still run (unless
    ``expect_running`` is false: a test may stop or kill it itself), and if it
    runs it is stopped with SIGTERM and must exit 0 and remove its socket file.
    Whatever happens, the process is killed if still alive and the temp dir removed.
    """
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    process: subprocess.Popen[str] | None = None
    try:
        socket_path = socket_path or tmp / "d.sock"
        listen = [f"unix://{socket_path}"] + (["127.0.0.1:0"] if tcp else [])
        config_path = write_config(tmp, datasets, workers=workers, listen=listen, **top)
        log_path = tmp / "daemon.log"
        process = popen_serve(config_path, log_path, *serve_args)
        daemon = RunningDaemon(process, f"unix://{socket_path}", socket_path, config_path, log_path)
        LIVE_DAEMONS.append(daemon)
        wait_serving(daemon.address, process, log_path, STARTUP_TIMEOUT_S)
        if tcp:
            for line in daemon.log().splitlines():
                if "listening on 127.0.0.1:" in line:
                    daemon.extra_addresses.append(line.rsplit(" ", 1)[-1])
            assert daemon.extra_addresses, f"no TCP address in the log:\n{daemon.log()}"
        try:
            yield daemon
        except (Exception, pytest.fail.Exception) as exc:  # the block failed (or timed out): what the daemon was doing, before it is killed
            try:
                dumped = dump_threads(daemon)
            except Exception as failed:  # the test's own failure must come out as it is
                dumped = f"no dump: {failed!r}"
            if dumped:
                exc.add_note(f"loaderd daemon at {daemon.address}: its threads and log:\n{dumped}")
            raise
        if process.poll() is None:
            code = daemon.stop()
            assert code == 0, f"daemon exited with {code}:\n{daemon.log()}"
            assert not socket_path.exists(), "daemon left its socket file behind"
        else:
            assert not expect_running, f"daemon died during the tests ({process.returncode}):\n{daemon.log()}"
    finally:
        LIVE_DAEMONS[:] = [d for d in LIVE_DAEMONS if d.process is not process]
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


# The daemons `running_daemon` started that have not ended yet (the suite's failure report dumps their threads).
LIVE_DAEMONS: list[RunningDaemon] = []
# How much of a daemon's log a failure report shows before its threads' stacks.
LOG_LINES_BEFORE_DUMP = 40


def dump_threads(daemon: RunningDaemon, timeout: float = 3.0) -> str:
    """The end of ``daemon``'s log with every one of its threads' stacks (``kill -USR1``:
    server/process/stack_dumps.py), for a failure's report: what a daemon that stopped answering was
    doing. "" if it no longer runs."""
    if daemon.process.poll() is not None or not daemon.log_path.exists():
        return ""
    before = daemon.log_path.stat().st_size
    daemon.process.send_signal(signal.SIGUSR1)
    # The dump is written from a signal handler, thread after thread: done once the log stops growing
    # (a stopped daemon writes nothing: the log's end, then, without its stacks).
    deadline, size, still_since = time.monotonic() + timeout, before, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = daemon.log_path.stat().st_size
        if now != size:
            size, still_since = now, time.monotonic()
        elif size > before and time.monotonic() - still_since > 0.3:
            break
    logged = daemon.log_path.read_bytes()  # once: the part before the signal and the dump, split where it was sent
    earlier = logged[:before].decode(errors="replace").splitlines()[-LOG_LINES_BEFORE_DUMP:]
    return "\n".join([*earlier, logged[before:].decode(errors="replace")])


@dataclass
class ClientProcess:
    """A Python client script run as a subprocess; its output lines arrive in ``lines``."""

    process: subprocess.Popen[str]
    lines: queue.Queue[str]

    def read_until(self, done: Callable[[str], bool], timeout: float, what: str) -> list[str]:
        """The lines printed up to the first one ``done`` accepts; fails with ``what`` after ``timeout`` s."""
        output: list[str] = []
        deadline = time.monotonic() + timeout
        while not (output and done(output[-1])):
            try:
                output.append(self.lines.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"{what} within {timeout:g} s: {''.join(output)}") from None
        return output

    def sigkill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        assert self.process.wait(10) == -signal.SIGKILL


@contextlib.contextmanager
def client_process(script: str, *args: str) -> Iterator[ClientProcess]:
    """Run ``python -c script args...``; killed at the end of the block if it still runs."""
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        yield ClientProcess(process, lines)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    reader.join(10)


# ------------------------------------------------------------------ the Prometheus endpoint

METRICS_LINE = re.compile(r"metrics on (http://\S+/metrics)")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def metrics_url(daemon_log: str) -> str:
    """The metrics endpoint a daemon's log names (config ``metrics: {port: 0}`` picks a free port)."""
    found = METRICS_LINE.search(daemon_log)
    assert found, f"no metrics line in the log:\n{daemon_log}"
    return found.group(1)


def scrape(url: str) -> Samples:
    """Every sample of the endpoint: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10.0) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
