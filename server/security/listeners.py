"""The daemon's listeners: each ``listen:`` entry bound with its credentials and socket permissions.

``prepare`` runs before the worker pool starts, so a missing certificate or an
unknown socket group fails at once (``ConfigError``, exit 2). ``bind`` adds the
ports to the gRPC server; ``secure_sockets`` runs right after ``server.start()``.

Unix sockets are created 0600 whatever the umask (the umask is narrowed while
gRPC binds, then each socket gets its entry's ``socket_mode``/``socket_group``):
a socket the whole group could reach by accident would let anyone there read
every dataset. TCP entries speak TLS when they have ``tls:``; plaintext beyond
loopback was refused by the config unless the entry says ``insecure: true``, and
then it is logged as a warning.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import socket
import stat
from dataclasses import dataclass

import grpc

from loaderd.server.config.schema import ConfigError, ListenSpec
from loaderd.server.security.tls import CertificateReloader, TlsConfigError
from loaderd.wire.addresses import is_loopback

log = logging.getLogger("loaderd")

DEFAULT_SOCKET_MODE = 0o600


class ListenError(Exception):
    """An address in ``listen:`` cannot be served."""


def unix_path(address: str) -> str | None:
    """The filesystem path of a unix: address, else None."""
    if address.startswith("unix://"):
        return address[len("unix://") :]
    if address.startswith("unix:"):
        return address[len("unix:") :]
    return None


@dataclass(frozen=True)
class Listener:
    """A ``listen:`` entry ready to bind: TLS files read, socket group resolved."""

    spec: ListenSpec
    tls: CertificateReloader | None = None
    gid: int | None = None

    @property
    def path(self) -> str | None:
        return unix_path(self.spec.address)

    def security(self) -> str:
        """How this listener is protected, for the log."""
        if self.path is not None:
            mode = self.spec.socket_mode if self.spec.socket_mode is not None else DEFAULT_SOCKET_MODE
            group = f", group {self.spec.socket_group}" if self.spec.socket_group is not None else ""
            return f"unix socket, mode {mode:04o}{group}"
        if self.tls is not None:
            return "TLS, client certificates required (mTLS)" if self.spec.tls and self.spec.tls.client_ca else "TLS"
        return "plaintext, loopback only" if is_loopback(self.spec.address) else "PLAINTEXT (insecure: true)"


def prepare(specs: tuple[ListenSpec, ...]) -> list[Listener]:
    """Read each entry's TLS files and resolve its socket group; ConfigError naming the entry otherwise."""
    listeners = []
    for i, spec in enumerate(specs):
        tls = None
        if spec.tls is not None:
            try:
                tls = CertificateReloader(spec.tls)
            except TlsConfigError as exc:
                raise ConfigError(f"listen[{i}] ({spec.address}): {exc}") from None
        gid = None
        if spec.socket_group is not None:
            group = spec.socket_group
            try:
                gid = group if isinstance(group, int) else grp.getgrnam(group).gr_gid
            except KeyError:
                raise ConfigError(f"listen[{i}].socket_group: no group named {group!r}") from None
            # chown to a group needs membership (or root): say so now, not after the pool warmed up.
            if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
                raise ConfigError(
                    f"listen[{i}].socket_group: this daemon's user is not a member of group {group!r}, so it cannot "
                    "give the socket to it (systemd: SupplementaryGroups=)"
                )
        listeners.append(Listener(spec, tls, gid))
    return listeners


def _answers(path: str) -> bool:
    """Whether a process accepts connections on the unix socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _in_use_message(where: str) -> str:
    return f"{where} is in use by a running process (another loaderd?)"


def tcp_in_use(host: str, port: int) -> bool:
    """Whether sockets already listen on TCP ``host``:``port`` at every address ``host`` names
    (``host`` "" is every interface): then no bind there can succeed.

    False where it cannot tell (port 0, a name that does not resolve, an address
    family this host lacks) or where one address is free (gRPC serves on the
    addresses it could bind): the bind itself then decides, as before.
    """
    if port == 0:
        return False
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    taken = 0
    for family, kind, proto, _, sockaddr in infos:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:  # a family this host lacks (IPv6 turned off)
            continue
        with probe:
            # As gRPC binds: a port whose old connections linger in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
                return False
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    continue  # cannot tell from this address
                taken += 1
    return taken > 0


def check_free(listeners: list[Listener]) -> None:
    """Refuse an address another process serves, before the pool starts (``bind`` would find it only after warm-up).

    A unix socket that answers is in use (one that does not is stale, removed at
    ``bind``); a TCP address is in use if a socket listens on it. An address taken
    between this check and ``bind`` still fails there, with the same kind of error.
    """
    for listener in listeners:
        path = listener.path
        if path is not None:
            if os.path.exists(path) and _answers(path):
                raise ListenError(_in_use_message(path))
            continue
        host, sep, port = listener.spec.address.rpartition(":")
        if sep and port.isdigit() and tcp_in_use(host.strip("[]"), int(port)):
            raise ListenError(_in_use_message(listener.spec.address))


def _claim_unix_path(path: str) -> None:
    """Remove a stale socket file left by a killed daemon; refuse a live one."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        return
    if _answers(path):
        raise ListenError(_in_use_message(path))
    os.unlink(path)  # nobody answers: stale


def bind(server: grpc.Server, listeners: list[Listener], created: list[str]) -> list[str]:
    """Add every listener's port to ``server`` (not started yet); returns the bound addresses (TCP port 0 resolved).

    ``created`` gets each unix socket path as soon as it exists (removed at shutdown, even if a later entry fails).

    Unix sockets are created with the umask narrowed to 0177, so none is ever
    reachable beyond its owner before ``secure_sockets`` sets its mode.
    """
    bound = []
    for listener in listeners:  # directories (mode 0755 under the umask) and stale files first
        if listener.path is not None:
            _claim_unix_path(listener.path)
    previous = os.umask(0o177)
    try:
        for listener in listeners:
            address = listener.spec.address
            path = listener.path
            try:
                if listener.tls is not None:
                    port = server.add_secure_port(address, listener.tls.credentials())
                else:
                    port = server.add_insecure_port(address)
            except RuntimeError as exc:
                raise ListenError(f"cannot listen on {address}: {exc}") from None
            if path is not None:
                created.append(path)
            bound.append(address if path is not None else f"{address.rsplit(':', 1)[0]}:{port}")
    finally:
        os.umask(previous)
    return bound


def secure_sockets(listeners: list[Listener]) -> None:
    """After ``server.start()``: give each unix socket its mode (0600 by default) and group."""
    for listener in listeners:
        path = listener.path
        if path is None:
            continue
        mode = listener.spec.socket_mode if listener.spec.socket_mode is not None else DEFAULT_SOCKET_MODE
        try:
            # Ours and a socket, not a link someone swapped in: chmod and chown follow links.
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
                raise ListenError(f"{path} is not the socket this daemon just created; refusing to change its mode")
            if listener.gid is not None:
                os.chown(path, -1, listener.gid)
            os.chmod(path, mode)
        except OSError as exc:
            raise ListenError(f"cannot set mode {mode:04o} on {path}: {exc.strerror or exc}") from None


def log_listening(listeners: list[Listener], bound: list[str]) -> None:
    """One line per address (tools read ``listening on ADDRESS`` at the end of a line), then how it is protected."""
    for listener, address in zip(listeners, bound, strict=True):
        log.info("listening on %s", address)
        if listener.path is None and listener.tls is None and not is_loopback(address):
            log.warning(
                "%s serves PLAINTEXT (insecure: true): anyone who can reach it can read every dataset "
                "and, without auth, every client's status",
                address,
            )
        else:
            log.info("%s: %s", address, listener.security())
