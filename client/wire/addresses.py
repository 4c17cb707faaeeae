"""Where a loader finds its daemons: the forms ``address=`` and ``$LOADERD_ADDRESS`` take.

With neither, a loader (and ``loaderd status``) use ``DEFAULT_ADDRESS``, where
``loaderd serve`` listens when its config has no ``listen:``.

* one address: ``unix:///run/loaderd.sock``, ``unix:relative.sock``, ``host:port``,
  ``tcp://host:port``, ``[::1]:7070``;
* several: a list of those, or one string with commas between them;
* ``dns:///name:port`` (also ``dns:name:port``): every A/AAAA record of
  ``name`` is a daemon on ``port``, e.g. a Kubernetes headless Service. The
  name is looked up again while a loader iterates (``Target.resolve``), so
  daemons that appear get work and ones that vanish lose it.

Parts combine: ``"dns:///loaderd:7070,10.0.0.5:7070"`` is every daemon the
name resolves to, plus one more.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from loaderd.errors import LoaderdError
from loaderd.wire.limits import DEFAULT_ADDRESS

__all__ = ["ADDRESS_ENV", "DEFAULT_ADDRESS", "Resolved", "Target", "is_loopback", "lookup", "parse_target", "single_address"]

ADDRESS_ENV = "LOADERD_ADDRESS"
# The "scheme://" prefixes an address may have (dns: is parsed before).
_SCHEMES = ("unix", "tcp")


@dataclass(frozen=True)
class Resolved:
    """One look-up of a target: the daemons' addresses, and why a DNS part gave none."""

    addresses: tuple[str, ...]
    problems: tuple[str, ...] = ()
    # (address, DNS name it came from): TLS checks a daemon's certificate against the name, not the IP.
    names: tuple[tuple[str, str], ...] = ()

    def name_of(self, address: str) -> str:
        """The DNS name ``address`` was found under, or "" for an address given as is."""
        return next((name for a, name in self.names if a == address), "")


def _dns_part(part: str) -> tuple[str, int] | None:
    """(name, port) of a ``dns:`` part, None for any other; LoaderdError if it is malformed."""
    if not part.startswith("dns:"):
        return None
    rest = part[len("dns:") :]
    if rest.startswith("//"):
        rest = rest[2:].split("/", 1)[1] if "/" in rest[2:] else ""  # dns://[authority]/name:port; the authority is ignored
    name, sep, port = rest.rpartition(":")
    name = name.strip("[]")
    if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise LoaderdError(f"malformed DNS address {part!r}: expected dns:///name:port")
    return name, int(port)


def is_loopback(address: str) -> bool:
    """Whether ``address`` stays on this host: a unix socket, or TCP to 127.0.0.0/8, ::1 or localhost.

    A host name other than localhost is not loopback: it may resolve to anything.
    """
    if address.startswith("unix:"):
        return True
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def lookup(name: str, port: int) -> list[str]:
    """The daemons' addresses that ``name`` resolves to (A and AAAA records), sorted; OSError if none."""
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({_join(str(info[4][0]), port) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)})


@dataclass(frozen=True)
class Target:
    """The daemons a loader may use, as given (``text`` is for messages)."""

    text: str
    fixed: tuple[str, ...]
    names: tuple[tuple[str, int], ...]

    @property
    def dynamic(self) -> bool:
        """Whether the set of daemons can change (a DNS name is part of it)."""
        return bool(self.names)

    def resolve(self) -> Resolved:
        """The addresses now: the fixed ones and what each name resolves to (a slow DNS can block here)."""
        found = list(self.fixed)
        problems = []
        names: list[tuple[str, str]] = []
        for name, port in self.names:
            try:
                new = [a for a in lookup(name, port) if a not in found]
            except OSError as exc:
                problems.append(f"dns:///{name}:{port} did not resolve ({exc.strerror or exc})")
                continue
            found.extend(new)
            names.extend((a, name) for a in new)
        return Resolved(tuple(found), tuple(problems), tuple(names))


def parse_target(address: str | Sequence[str] | None) -> Target:
    """``address`` (else ``$LOADERD_ADDRESS``, else ``DEFAULT_ADDRESS``) in any of the module docstring's forms;
    LoaderdError if malformed."""
    if address is None or address == "":
        address = os.environ.get(ADDRESS_ENV, "") or DEFAULT_ADDRESS
    if isinstance(address, str):
        parts = address.split(",")
        text = address
    else:
        if not all(isinstance(a, str) for a in address):
            raise LoaderdError(f"address: expected a string or a list of strings, got {address!r}")
        parts = [p for a in address for p in a.split(",")]
        text = ",".join(address)
    fixed: list[str] = []
    names: list[tuple[str, int]] = []
    for raw in parts:
        part = raw.strip()
        if not part:
            continue
        dns = _dns_part(part)
        if dns is not None:
            if dns not in names:
                names.append(dns)
            continue
        if part.startswith(("/", "./")) or (part.endswith(".sock") and not part.startswith("unix:")):
            raise LoaderdError(f"address {part!r} looks like a socket path: write unix://{part} (unix:///abs/path or unix:rel/path)")
        scheme, sep, rest = part.partition("://")
        if sep and scheme.lower() not in _SCHEMES:
            # Refused at once: gRPC would read "http://h:p" as a DNS name and retry it for the whole failover_timeout.
            raise LoaderdError(
                f"address {part!r}: loaderd speaks gRPC, not {scheme}; write {rest.split('/')[0] or 'host:port'} "
                "(host:port, tcp://host:port, unix:///path or dns:///name:port)"
            )
        plain = part.removeprefix("tcp://")
        if plain not in fixed:
            fixed.append(plain)
    if not fixed and not names:
        raise LoaderdError(f"no daemon address in {text!r}")
    return Target(text=text, fixed=tuple(fixed), names=tuple(names))


def single_address(address: str | None) -> str:
    """One daemon's address for tools that talk to exactly one (``loaderd status``): the first given."""
    target = parse_target(address)
    if target.fixed:
        return target.fixed[0]
    resolved = target.resolve()
    if not resolved.addresses:
        raise LoaderdError("; ".join(resolved.problems) or f"{target.text} names no daemon")
    return resolved.addresses[0]
