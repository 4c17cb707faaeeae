"""Several real `loaderd serve` processes on loopback, to kill, restart, drain and add.

Each daemon listens on its own loopback address (127.0.0.2, 127.0.0.3, ...)
and all on the same port, as the daemons behind a Kubernetes headless Service
do: ``Cluster.running_hosts`` is what a DNS server would answer for them, and tests
inject it (``inject_dns``) in place of the system resolver's. A daemon keeps
its address across restarts. Used by tests/faults/test_failover.py and the benches.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.daemons import STARTUP_TIMEOUT_S, daemon_status, popen_serve, wait_serving, write_config


def free_port(hosts: list[str]) -> int:
    """A TCP port free on every one of ``hosts`` right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
            return int(port)
        except OSError:
            continue
    raise RuntimeError(f"no port free on all of {hosts}")


@dataclass
class Member:
    """One daemon of the cluster: its address survives restarts."""

    index: int
    host: str
    port: int
    directory: Path
    config_path: Path
    process: subprocess.Popen[str] | None = None
    starts: int = 0
    logs: list[Path] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, wait: bool = True) -> None:
        """Start the daemon (again); with ``wait``, return once it is SERVING."""
        assert not self.running, f"daemon {self.index} runs already"
        self.starts += 1
        log = self.directory / f"daemon-{self.starts}.log"
        self.logs.append(log)
        self.process = popen_serve(self.config_path, log)
        if wait:
            self.wait_serving()

    def wait_serving(self) -> None:
        assert self.process is not None
        wait_serving(self.address, self.process, self.logs[-1], STARTUP_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL: no drain, no cleanup (the next daemon sweeps its shared memory)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (a drain, then the shutdown protocol); returns the exit code."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def log(self) -> str:
        return "".join(f"--- {path.name}\n{path.read_text()}" for path in self.logs if path.exists())

    def delivered(self) -> int:
        """Batches the running daemon delivered, over every dataset (Status)."""
        return sum(d.batches_delivered for d in daemon_status(self.address).datasets)


@dataclass
class Cluster:
    members: list[Member]

    def __getitem__(self, index: int) -> Member:
        return self.members[index]

    @property
    def addresses(self) -> list[str]:
        return [m.address for m in self.members]

    def running_hosts(self) -> list[str]:
        """What a DNS server answers for a headless Service over these daemons: the running ones' IPs."""
        return [m.host for m in self.members if m.running]

    def logs(self) -> str:
        return "\n".join(m.log() for m in self.members)


@contextlib.contextmanager
def cluster(
    datasets: dict[str, Any] | list[dict[str, Any]], size: int, *, workers: int = 2, start: bool = True, **top: Any
) -> Iterator[Cluster]:
    """``size`` daemons serving ``datasets`` (or one datasets dict per daemon), each on 127.0.0.<2+i>, one port.

    Every daemon still running at the end is SIGTERM'd and must exit 0; any
    left is killed, and the temp dir removed.
    """
    directory = Path(tempfile.mkdtemp(prefix="ld-cluster-", dir="/tmp"))
    hosts = [f"127.0.0.{2 + i}" for i in range(size)]
    port = free_port(hosts)
    members = []
    for i, host in enumerate(hosts):
        own = directory / f"d{i}"
        own.mkdir()
        config = write_config(own, datasets[i] if isinstance(datasets, list) else datasets, workers=workers, listen=[f"{host}:{port}"], **top)
        members.append(Member(i, host, port, own, config))
    group = Cluster(members)
    try:
        if start:
            for member in members:
                member.start(wait=False)
            for member in members:
                member.wait_serving()
        yield group
        for member in members:
            if member.running:
                code = member.terminate()
                assert code == 0, f"daemon {member.index} exited with {code}:\n{member.log()}"
    finally:
        for member in members:
            if member.running:
                assert member.process is not None
                member.process.kill()
                member.process.wait(10)
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def inject_dns(name: str, hosts: Callable[[], list[str]]) -> Iterator[None]:
    """Make ``socket.getaddrinfo(name, port)`` answer A records ``hosts()`` (asked anew at each look-up)."""
    real = socket.getaddrinfo

    def fake(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        if host != name:
            return real(host, port, *args, **kwargs)
        found = hosts()
        if not found:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, int(port))) for ip in found]

    socket.getaddrinfo = fake  # type: ignore[assignment]
    try:
        yield
    finally:
        socket.getaddrinfo = real  # type: ignore[assignment]
