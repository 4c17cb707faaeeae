"""How a client proves itself to daemons: TLS files and a bearer token.

``Credentials.resolve(tls, token)`` turns ``RemoteDataLoader``'s (or ``loaderd
status``'s) arguments into one frozen value, with the environment as defaults:
``$LOADERD_TLS_CA``, ``$LOADERD_TLS_CERT``, ``$LOADERD_TLS_KEY`` and
``$LOADERD_TOKEN``. ``tls=True`` uses the system's root certificates; a mapping
names ``ca`` (the CA that signed the daemon's certificate) and, for mTLS,
``cert`` and ``key``; ``tls=False`` turns TLS off whatever the environment says.

TLS applies to TCP addresses; a unix socket is protected by its file mode, so
its channel is plaintext even with TLS configured. The token goes with every
call, unix sockets included. ``open_channel`` is the one place channels are made.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from loaderd.channel.rpc_errors import tls_failure
from loaderd.errors import AuthenticationError, CredentialsError
from loaderd.wire.addresses import is_loopback

log = logging.getLogger("loaderd.credentials")

TLS_CA_ENV = "LOADERD_TLS_CA"
TLS_CERT_ENV = "LOADERD_TLS_CERT"
TLS_KEY_ENV = "LOADERD_TLS_KEY"
TOKEN_ENV = "LOADERD_TOKEN"
_TLS_KEYS = {"ca", "cert", "key"}


@dataclass(frozen=True)
class Credentials:
    """TLS (PEM bytes; ``tls`` False means plaintext) and a token ("" for none). Hashable: a connection key.

    Secrets stay out of its repr (loaders, fleets and tracebacks that show locals print it).
    """

    tls: bool = False
    ca: bytes | None = field(default=None, repr=False)  # None with tls: the system roots
    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)
    token: str = field(default="", repr=False)
    # Where cert and key came from (``diagnose`` hands them to the ssl module, which reads files).
    cert_path: str = ""
    key_path: str = ""
    # The name the daemon's certificate must carry when the address is an IP found under a DNS
    # name (``dns:///loaderd:7070``: certificates name the service, not each pod's IP).
    server_name: str = ""

    @classmethod
    def resolve(cls, tls: bool | Mapping[str, str] | None = None, token: str | None = None) -> Credentials:
        """The arguments, each defaulting to the environment; CredentialsError naming what is wrong."""
        if token is None:
            token = os.environ.get(TOKEN_ENV, "")
        if not isinstance(token, str) or any(c in token for c in "\r\n"):
            raise CredentialsError("token: expected a string without line breaks")
        token = token.strip()
        if tls is None:
            from_env = {k: os.environ.get(env, "") for k, env in (("ca", TLS_CA_ENV), ("cert", TLS_CERT_ENV), ("key", TLS_KEY_ENV))}
            tls = {k: v for k, v in from_env.items() if v} or False
        if tls is False:
            return cls(token=token)
        if tls is True:
            return cls(tls=True, token=token)
        if not isinstance(tls, Mapping):
            raise CredentialsError(f"tls: expected True, False or a mapping with 'ca', 'cert', 'key', got {type(tls).__name__}")
        unknown = sorted(set(tls) - _TLS_KEYS)
        if unknown:
            raise CredentialsError(f"tls: unknown key {unknown[0]!r} (allowed: ca, cert, key)")
        if bool(tls.get("cert")) != bool(tls.get("key")):
            raise CredentialsError("tls: 'cert' and 'key' go together (a client certificate and its key)")
        return cls(
            tls=True,
            ca=_read(tls.get("ca"), "ca"),
            cert=_read(tls.get("cert"), "cert"),
            key=_read(tls.get("key"), "key"),
            token=token,
            cert_path=os.fspath(tls.get("cert") or ""),
            key_path=os.fspath(tls.get("key") or ""),
        )


def _read(path: Any, what: str) -> bytes | None:
    if not path:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise CredentialsError(f"tls.{what}: expected a file path, got {type(path).__name__}")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise CredentialsError(f"tls.{what}: cannot read {path}: {exc.strerror or exc}") from None


def is_unix(address: str) -> bool:
    return address.startswith("unix:")


class _TokenMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = list(details.metadata or ())
        metadata.append(self._entry)
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


_warned_plaintext_token: set[str] = set()


def open_channel(address: str, credentials: Credentials, options: list[tuple[str, Any]]) -> grpc.Channel:
    """A channel to ``address`` speaking what ``credentials`` say (see the module docstring)."""
    if credentials.tls and not is_unix(address):
        creds = grpc.ssl_channel_credentials(credentials.ca, credentials.key, credentials.cert)
        if credentials.server_name:
            options = [*options, ("grpc.ssl_target_name_override", credentials.server_name)]
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        if credentials.token and not is_loopback(address) and address not in _warned_plaintext_token:
            _warned_plaintext_token.add(address)
            log.warning("sending a token in plaintext to %s: anyone on the path can read it; use tls=", address)
        channel = grpc.insecure_channel(address, options=options)
    if credentials.token:
        return grpc.intercept_channel(channel, _TokenMetadata(credentials.token))
    return channel


def _host_port(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def diagnose(address: str, credentials: Credentials, timeout: float = 1.0) -> str:
    """Why a daemon closes connections at once, when TLS is the cause; "" otherwise (or if unknown).

    gRPC reports both a plaintext client at a TLS port and a client certificate an
    mTLS port refused as "Socket closed", as it would a daemon going down. One TLS
    handshake with Python's ssl module (no verification: only the daemon's
    verdict matters) tells them apart: the daemon answers after the handshake
    (it speaks TLS and takes this client), closes (it refused the client's
    certificate), or the handshake fails (it does not speak TLS).
    """
    where = _host_port(address)
    if is_unix(address) or where is None:
        return ""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        if credentials.tls and credentials.cert_path:
            # An encrypted key must not make OpenSSL prompt on a terminal from a probing thread.
            context.load_cert_chain(credentials.cert_path, credentials.key_path or None, password=lambda: b"")
        with socket.create_connection(where, timeout=timeout) as raw, context.wrap_socket(raw) as conn:
            conn.settimeout(timeout)
            answered = bool(conn.recv(1))
    except (ssl.SSLError, OSError):
        return ""  # no TLS there, or the network failed: nothing TLS-specific to say
    if not credentials.tls:
        return (
            f"the daemon at {address} speaks TLS and this client sent plaintext: pass tls=True (system roots) "
            "or tls={'ca': ...}, or set $LOADERD_TLS_CA"
        )
    if not answered:
        having = "its certificate" if credentials.cert_path else "no certificate"
        return (
            f"the daemon at {address} requires a client certificate signed by its client_ca (mTLS) and refused this "
            f"client, which presented {having}: pass tls={{'ca': ..., 'cert': ..., 'key': ...}} with one it trusts"
        )
    return ""


def refusal(exc: grpc.RpcError, address: str, credentials: Credentials) -> AuthenticationError | None:
    """The error when a failed call means this client's TLS cannot work with the daemon at ``address``, else None.

    A handshake this client failed says why in the call's details (``tls_failure``); a
    daemon that closes every connection at once may be refusing TLS or plaintext, which
    only ``diagnose`` can tell (gRPC reports it as "Socket closed", like a daemon going away).
    """
    failure = tls_failure(exc, address)
    if failure is not None:
        return failure
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or ""
    if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNAVAILABLE and "Socket closed" in details:
        why = diagnose(address, credentials)
        if why:
            return AuthenticationError(why)
    return None
