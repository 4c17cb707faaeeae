"""Who is calling: bearer tokens from a token file, certificate subjects from mTLS.

``auth: {token_file: tokens.txt}`` turns token checks on. The file holds lines
``name:token`` (blank lines and ``#`` comments are skipped). When it is set,
every RPC except the standard health service's ``Check`` needs ``authorization: Bearer
<token>`` metadata, on every listener, unix sockets included; the token's name
identifies the client in logs, ``loaderd status`` and metrics. Without a token
file, a client is named by its TLS certificate's subject (mTLS listeners), or
not at all.

Rules:
- tokens are compared with ``hmac.compare_digest`` against every entry, so the
  time taken does not say how much of a guess was right;
- the file is re-read when it changes (size, mtime or inode; a Kubernetes Secret
  swaps a symlink), so tokens rotate without a restart; a file that becomes
  unreadable or malformed keeps the last good tokens and logs why;
- a token file that other users can read or change is refused at start
  (``TokenFileError``): it must belong to the daemon's user or root, with no
  permission bits for "other", and group read only when root owns the file (a
  Kubernetes Secret volume mounted with ``defaultMode: 0440`` and an ``fsGroup``:
  PostgreSQL's rule for key files);
- refused calls are logged (rate-limited) with the caller's address and method,
  never the token.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from loaderd.server.process.throttle import LogThrottle
from loaderd.wire.reasons import Reason, abort

log = logging.getLogger("loaderd.auth")

# The one call that needs no token: probes (kubelet, Docker's HEALTHCHECK, load balancers)
# use Check. Watch is a long call holding a handler thread, so it needs a token like the rest.
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
BEARER = "bearer "
MAX_TOKEN_FILE_BYTES = 1 << 20


class TokenFileError(Exception):
    """The token file cannot be used; the message names it and says why."""


@dataclass(frozen=True)
class Identity:
    """Who a call comes from: ``name`` is what logs, status and metrics show ("" if unknown)."""

    name: str = ""

    def __str__(self) -> str:
        return self.name or "anonymous"


ANONYMOUS = Identity()


def check_private(path: Path) -> os.stat_result:
    """``path``'s stat if no other user can read it; TokenFileError otherwise."""
    try:
        st = path.stat()
    except OSError as exc:
        raise TokenFileError(f"auth.token_file: cannot read {path}: {exc.strerror or exc}") from None
    if st.st_uid not in (0, os.getuid()):
        raise TokenFileError(f"auth.token_file: {path} belongs to uid {st.st_uid}, who could add tokens; it must be this user's or root's")
    mode = stat.S_IMODE(st.st_mode)
    readable_by_group = bool(mode & stat.S_IRGRP) and st.st_uid != 0
    if mode & 0o007 or readable_by_group or mode & stat.S_IWGRP:
        raise TokenFileError(
            f"auth.token_file: {path} has mode {mode:04o}: other users can read or change it; "
            f"chmod 600 {path} (or 0440, owned by root, for a group-mounted secret)"
        )
    return st


def parse_tokens(text: str, path: Path) -> dict[str, str]:
    """``name:token`` lines as {name: token}; TokenFileError naming the line otherwise."""
    tokens: dict[str, str] = {}
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, token = line.partition(":")
        name, token = name.strip(), token.strip()
        if not sep or not name or not token:
            raise TokenFileError(f"auth.token_file: {path}, line {number}: expected 'name:token'")
        if name in tokens:
            raise TokenFileError(f"auth.token_file: {path}, line {number}: the name {name!r} appears twice")
        if token in seen:
            raise TokenFileError(f"auth.token_file: {path}, line {number}: that token is already given to another name")
        tokens[name] = token
        seen.add(token)
    if not tokens:
        raise TokenFileError(f"auth.token_file: {path} holds no 'name:token' line")
    return tokens


class TokenFile:
    """The tokens of one file, re-read when the file changes (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        """Read ``path`` now; TokenFileError if it is not private or holds no valid token."""
        self.path = path
        self._lock = threading.Lock()
        st = check_private(path)
        self._tokens = self._read()
        self._stamp = _stamp(st)

    def _read(self) -> list[tuple[str, bytes]]:
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_TOKEN_FILE_BYTES + 1)
        except OSError as exc:
            raise TokenFileError(f"auth.token_file: cannot read {self.path}: {exc.strerror or exc}") from None
        if len(data) > MAX_TOKEN_FILE_BYTES:
            raise TokenFileError(f"auth.token_file: {self.path} is over {MAX_TOKEN_FILE_BYTES} bytes")
        tokens = parse_tokens(data.decode("utf-8", errors="replace"), self.path)
        return [(name, token.encode()) for name, token in tokens.items()]

    def _current(self) -> list[tuple[str, bytes]]:
        try:
            st = self.path.stat()
        except OSError:
            return self._tokens  # being replaced: keep the last good tokens
        stamp = _stamp(st)
        if stamp == self._stamp:
            return self._tokens
        with self._lock:
            if stamp != self._stamp:
                try:
                    check_private(self.path)
                    self._tokens = self._read()
                    log.info("token file %s re-read: %d tokens", self.path, len(self._tokens))
                except TokenFileError as exc:
                    log.error("%s; keeping the %d tokens read before", exc, len(self._tokens))
                self._stamp = stamp
            return self._tokens

    def name_of(self, token: str) -> str | None:
        """The name ``token`` was given, or None. Every entry is compared (constant time each)."""
        presented = token.encode()
        found = None
        for name, known in self._current():
            if hmac.compare_digest(presented, known):
                found = name
        return found


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` metadata entry, if any."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value[: len(BEARER)].lower() == BEARER:
            return value[len(BEARER) :].strip()
    return None


def certificate_name(context: grpc.ServicerContext) -> str:
    """The verified client certificate's name on an mTLS connection, or "".

    Its common name if it has one, else its first subject alternative name (certificates
    made for services often carry only those), else its whole subject.
    """
    try:
        auth = context.auth_context()
    except Exception:  # noqa: BLE001 - no security on this connection
        return ""
    for key in ("x509_common_name", "x509_subject_alternative_name", "x509_subject"):
        for value in auth.get(key) or ():
            if value:
                return value.decode(errors="replace")
    return ""


class Authenticator:
    """Decides who a call is from, and whether it may be served at all."""

    def __init__(self, tokens: TokenFile | None) -> None:
        """``tokens``: the token file, or None when the config has no ``auth:`` (every call allowed)."""
        self.tokens = tokens

    @property
    def required(self) -> bool:
        return self.tokens is not None

    def identify(self, context: grpc.ServicerContext) -> Identity:
        """The caller's identity (the interceptor already refused calls without a valid token)."""
        if self.tokens is not None:
            token = bearer_token(context.invocation_metadata())
            name = self.tokens.name_of(token) if token is not None else None
            if name is not None:
                return Identity(name)
        subject = certificate_name(context)
        return Identity(subject) if subject else ANONYMOUS

    def check_token(self, metadata: Sequence[tuple[str, Any]] | None) -> str:
        """"" if the call may proceed, else why not (for UNAUTHENTICATED)."""
        if self.tokens is None:
            return ""
        token = bearer_token(metadata)
        if token is None:
            return "this daemon requires a token: send 'authorization: Bearer <token>' (RemoteDataLoader(token=...) or $LOADERD_TOKEN)"
        if self.tokens.name_of(token) is None:
            return "the token is not valid for this daemon"
        return ""


def _refuse(handler: grpc.RpcMethodHandler, method: str, why: str, throttle: LogThrottle) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED without reading the request."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        throttle.log(logging.WARNING, "unauthenticated", "%s from %s refused: %s", method, context.peer(), why)
        abort(context, grpc.StatusCode.UNAUTHENTICATED, why, Reason.UNAUTHENTICATED)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call but health's Check without a valid bearer token (UNAUTHENTICATED)."""

    def __init__(self, authenticator: Authenticator) -> None:
        self._auth = authenticator
        self._throttle = LogThrottle(log)

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        method: str = details.method
        if handler is None or method == HEALTH_CHECK:
            return handler
        why = self._auth.check_token(details.invocation_metadata)
        return handler if not why else _refuse(handler, method, why, self._throttle)
