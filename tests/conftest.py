"""Fixtures that start a real `loaderd serve` and wait for it to be SERVING."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

TESTS_DIR = Path(__file__).resolve().parent
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

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal the daemon and wait for it to exit; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
            raise AssertionError(f"daemon did not exit within {timeout}s after {sig}:\n{self.log()}")


def wait_serving(address: str, process: subprocess.Popen[str] | None, log_path: Path | None, timeout: float) -> None:
    """Poll the standard health service until SERVING (never sleep-and-hope)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
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


def write_config(directory: Path, datasets: dict[str, Any], **top: Any) -> Path:
    config = {"python_path": [str(TESTS_DIR)], "datasets": datasets, **top}
    path = directory / "ds.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def serve_command(config_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "loaderd.server.cli", "serve", "--config", str(config_path), *extra]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir: unix socket paths are limited to ~100 characters."""
    path = Path(tempfile.mkdtemp(prefix="ld-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_daemon(short_tmp: Path) -> Iterator[Callable[..., RunningDaemon]]:
    """Start a daemon on a temp unix socket with the given datasets; stopped (and checked) at teardown."""
    started: list[RunningDaemon] = []

    def start(datasets: dict[str, Any], workers: int = 2, tcp: bool = False, **top: Any) -> RunningDaemon:
        n = len(started)
        socket_path = short_tmp / f"d{n}.sock"
        listen = [f"unix://{socket_path}"] + (["127.0.0.1:0"] if tcp else [])
        config_dir = short_tmp / f"cfg{n}"
        config_dir.mkdir()
        config_path = write_config(config_dir, datasets, workers=workers, listen=listen, **top)
        log_path = config_dir / "daemon.log"
        log_file = open(log_path, "w")
        process = subprocess.Popen(serve_command(config_path), stdout=log_file, stderr=subprocess.STDOUT, text=True)
        log_file.close()
        daemon = RunningDaemon(process, f"unix://{socket_path}", socket_path, config_path, log_path)
        started.append(daemon)
        wait_serving(daemon.address, process, log_path, STARTUP_TIMEOUT_S)
        if tcp:
            for line in daemon.log().splitlines():
                if "listening on 127.0.0.1:" in line:
                    daemon.extra_addresses.append(line.rsplit(" ", 1)[-1])
        return daemon

    yield start
    for daemon in started:
        if daemon.process.poll() is None:
            code = daemon.stop()
            assert code == 0, f"daemon exited with {code}:\n{daemon.log()}"
            assert not daemon.socket_path.exists(), "daemon left its socket file behind"
