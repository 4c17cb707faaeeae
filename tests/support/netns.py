"""Hosts on this machine: network namespaces on one bridge, each with its own address and its own /dev/shm.

``HostBed(n)`` makes a switch namespace holding a bridge, and ``n`` host namespaces, each joined to
the bridge by a veth pair (``eth0`` inside the host, ``<host>-sw`` on the switch) with the address
``10.99.0.<i+1>/24``. ``bed.popen(host, argv)`` runs a command in a host's namespace, in a mount
namespace of its own whose /dev/shm is a fresh tmpfs: a client there cannot map a daemon's shared
memory, so it really takes the gRPC path, as from another machine. The file system is otherwise
shared, so the test process reaches each daemon's unix socket (Status, health) without the network.

Faults, each on one host's link, on a kernel without netem or tc actions: a token bucket filter
with a one-byte bucket drops every packet (no reset, no ICMP: a partition).

- ``cut(host, "both")``: nothing in or out; ``"out"``: nothing the host sends arrives; ``"in"``:
  nothing reaches it (one-way cuts);
- ``slow(host, rate)``: both directions limited to ``rate`` (tbf, e.g. "2mbit");
- ``heal(host)``: the link as it was;
- freezing a host's processes is the caller's (SIGSTOP to the processes it started).

Needs root and iproute2 (``HostBed.unavailable()`` says why not, for a skip). Every namespace,
link and process the bed made goes at ``close()``; traffic never leaves its namespaces.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

SUBNET = "10.99.0"
SHM_SIZE = "2g"
# A drop-everything qdisc: a one-byte bucket passes no packet.
_DROP = ["tbf", "rate", "8bit", "burst", "1", "limit", "1"]
_COMMAND_TIMEOUT_S = 10.0


@dataclass
class Host:
    """One namespace on the bed: ``address`` is its IPv4 address on the bridge."""

    name: str
    netns: str
    address: str
    outer: str  # its veth's switch-side end (egress: what the host receives)
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    subprocess.run(command, check=True, capture_output=True, timeout=_COMMAND_TIMEOUT_S)


def _tc(netns: str, device: str, *args: str, check: bool = True) -> None:
    subprocess.run(["tc", "-n", netns, "qdisc", *args[:1], "dev", device, *args[1:]], check=check, capture_output=True, timeout=_COMMAND_TIMEOUT_S)


class HostBed:
    """Hosts in network namespaces (see the module docstring); use as a context manager."""

    def __init__(self, names: Sequence[str], tag: str | None = None) -> None:
        tag = tag or f"ld{os.getpid() % 100000}"
        self._switch = f"{tag}-sw"
        self.hosts = {name: Host(name, f"{tag}-{name}", f"{SUBNET}.{i + 1}", f"{tag[:6]}{i}sw") for i, name in enumerate(names)}
        self._made: list[str] = []

    @staticmethod
    def unavailable() -> str | None:
        """Why a bed cannot be made here (a reason to skip), or None."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "tc", "unshare", "mount"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed (iproute2, util-linux)"
        probe = f"ldprobe{os.getpid() % 100000}"
        try:
            _ip("netns", "add", probe)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            return f"cannot make a network namespace: {getattr(exc, 'stderr', b'') or exc}"
        _ip("netns", "del", probe)
        return None

    def __enter__(self) -> HostBed:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self._switch)
        self._made.append(self._switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self._switch)
        _ip("link", "set", "br0", "up", netns=self._switch)
        for host in self.hosts.values():
            _ip("netns", "add", host.netns)
            self._made.append(host.netns)
            # Made inside the host's namespace, the switch end moved out to the bridge.
            _ip("link", "add", "eth0", "type", "veth", "peer", "name", host.outer, netns=host.netns)
            _ip("link", "set", host.outer, "netns", self._switch, netns=host.netns)
            _ip("link", "set", host.outer, "master", "br0", netns=self._switch)
            _ip("link", "set", host.outer, "up", netns=self._switch)
            _ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=host.netns)
            _ip("link", "set", "eth0", "up", netns=host.netns)
            _ip("link", "set", "lo", "up", netns=host.netns)

    # ------------------------------------------------------------------ processes

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``host``: its network namespace, and a private /dev/shm (a fresh tmpfs)."""
        where = self.hosts[host]
        script = f'mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm && exec "$@"'
        command = ["ip", "netns", "exec", where.netns, "unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]
        process = subprocess.Popen(command, **kwargs)
        where.processes.append(process)
        return process

    def freeze(self, host: str, frozen: bool = True) -> None:
        """SIGSTOP (or SIGCONT) every process started on ``host`` that still runs, and their children."""
        sig = signal.SIGSTOP if frozen else signal.SIGCONT
        for pid in self._pids(host):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _pids(self, host: str) -> list[int]:
        """Every process in ``host``'s network namespace (``ip netns pids``)."""
        result = subprocess.run(
            ["ip", "netns", "pids", self.hosts[host].netns], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
        return [int(pid) for pid in result.stdout.split()]

    # ------------------------------------------------------------------ faults

    def cut(self, host: str, direction: str = "both") -> None:
        """Drop every packet ``host`` sends (``"out"``), receives (``"in"``), or both, silently."""
        self.heal(host)
        where = self.hosts[host]
        if direction in ("out", "both"):
            _tc(where.netns, "eth0", "add", "root", *_DROP)
        if direction in ("in", "both"):
            _tc(self._switch, where.outer, "add", "root", *_DROP)

    def slow(self, host: str, rate: str, burst: str = "32kbit", latency: str = "50ms") -> None:
        """Limit ``host``'s link to ``rate`` each way (a token bucket filter)."""
        self.heal(host)
        where = self.hosts[host]
        shape = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        _tc(where.netns, "eth0", "add", "root", *shape)
        _tc(self._switch, where.outer, "add", "root", *shape)

    def heal(self, host: str) -> None:
        """``host``'s link as it was: no cut, no limit."""
        where = self.hosts[host]
        _tc(where.netns, "eth0", "del", "root", check=False)
        _tc(self._switch, where.outer, "del", "root", check=False)

    def heal_all(self) -> None:
        for host in self.hosts:
            self.heal(host)

    def dropped(self, host: str) -> int:
        """Packets dropped on ``host``'s link so far (both directions), for a test to see its cut bite."""
        total = 0
        where = self.hosts[host]
        for netns, device in ((where.netns, "eth0"), (self._switch, where.outer)):
            command = ["tc", "-n", netns, "-s", "qdisc", "show", "dev", device]
            out = subprocess.run(command, capture_output=True, text=True, check=False, timeout=_COMMAND_TIMEOUT_S).stdout
            for word, following in zip(out.split(), out.split()[1:]):
                if word == "(dropped":
                    total += int(following.rstrip(","))
        return total

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Kill every process on the bed and remove its namespaces and links. Idempotent."""
        for host in self.hosts.values():
            if host.netns in self._made:
                self.freeze(host.name, frozen=False)
                for pid in self._pids(host.name):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for process in host.processes:
                if process.poll() is None:
                    process.kill()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True, timeout=_COMMAND_TIMEOUT_S, check=False)


@contextmanager
def host_bed(names: Sequence[str]) -> Iterator[HostBed]:
    """A ``HostBed`` of hosts ``names``; skips the test (saying why) where one cannot be made."""
    import pytest

    reason = HostBed.unavailable()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    with HostBed(names) as bed:
        yield bed
