"""Real `loaderd serve` processes and client processes on the hosts of a ``HostBed`` (tests/support/netns.py).

Each daemon listens on its host's address (plaintext, ``insecure: true``: the bed's bridge is the
trusted network) and on a unix socket in a temp dir, which the test process (outside every network
namespace) uses for health and Status whatever the bed's links do. A client is a Python script run
on its own host; it prints lines the test reads (``BedClient.lines``).
"""

from __future__ import annotations

import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.daemons import STARTUP_TIMEOUT_S, TESTS_DIR, ClientProcess, daemon_status, serve_command, wait_serving, write_config
from support.netns import HostBed

PORT = 7070


@dataclass
class BedDaemon:
    """A daemon on a bed host: ``address`` over the bed, ``local`` (its unix socket) for the test."""

    host: str
    address: str
    local: str
    config_path: Path
    log_path: Path
    process: subprocess.Popen[str] | None = None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def status(self) -> Any:
        return daemon_status(self.local)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class BedClient(ClientProcess):
    """A client script on a bed host (``host``); its output lines arrive in ``lines``."""

    host: str = ""


class BedCluster:
    """Daemons on some of a bed's hosts (``daemons``) and clients on others (``client``)."""

    def __init__(self, bed: HostBed, datasets: dict[str, Any], **top: Any) -> None:
        self.bed = bed
        self._datasets = datasets
        self._top = top
        self._dir = Path(tempfile.mkdtemp(prefix="ld-bed-", dir="/tmp"))
        self.daemons: dict[str, BedDaemon] = {}
        self.clients: list[BedClient] = []

    def add_daemon(self, host: str) -> BedDaemon:
        """Configure (not start) a daemon on ``host``."""
        directory = self._dir / host
        directory.mkdir()
        address = f"{self.bed.hosts[host].address}:{PORT}"
        listen = [f"unix://{directory / 'd.sock'}", {"address": address, "insecure": True}]
        config_path = write_config(directory, self._datasets, listen=listen, **self._top)
        daemon = BedDaemon(host, address, f"unix://{directory / 'd.sock'}", config_path, directory / "daemon.log")
        self.daemons[host] = daemon
        return daemon

    def start(self, daemon: BedDaemon) -> None:
        """Start ``daemon`` (again) on its host and wait for SERVING; a restart appends to its log."""
        with open(daemon.log_path, "a") as log_file:
            daemon.process = self.bed.popen(daemon.host, serve_command(daemon.config_path), stdout=log_file, stderr=subprocess.STDOUT, text=True)
        wait_serving(daemon.local, daemon.process, daemon.log_path, STARTUP_TIMEOUT_S)

    def client(self, host: str, script: str, *args: str) -> BedClient:
        """Run ``python -c script args...`` on ``host`` (tests/ importable)."""
        process = self.bed.popen(
            host,
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r})\n" + script, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()  # type: ignore[union-attr]
        client = BedClient(process, lines, host)
        self.clients.append(client)
        return client

    def close(self) -> None:
        """Stop the daemons (SIGTERM, then the bed kills what is left) and remove their files."""
        self.bed.heal_all()
        for daemon in self.daemons.values():
            if daemon.running:
                assert daemon.process is not None
                daemon.process.terminate()
                try:
                    daemon.process.wait(15)
                except subprocess.TimeoutExpired:
                    daemon.process.kill()
                    daemon.process.wait(10)
        shutil.rmtree(self._dir, ignore_errors=True)


@contextmanager
def bed_cluster(bed: HostBed, datasets: dict[str, Any], **top: Any) -> Iterator[BedCluster]:
    cluster = BedCluster(bed, datasets, **top)
    try:
        yield cluster
    finally:
        cluster.close()
