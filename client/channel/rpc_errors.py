"""The one place where a failed gRPC call becomes a loaderd error (loaderd.errors holds the classes).

:func:`error_from_rpc` maps status codes to the error a user can act on, and reads the
daemon's reason (``loaderd.wire.reasons``) where the code alone cannot say (a limit of calls
open, which another daemon may not have reached, or of the request itself);
:func:`is_transient` says whether another daemon (or this one, later) may serve
the call; the rest words connection and TLS failures for people.
"""

from __future__ import annotations

import grpc

from loaderd.errors import (
    AuthenticationError,
    BatchTimeoutError,
    DaemonUnavailableError,
    DatasetNotFoundError,
    InvalidRequestError,
    LimitExceededError,
    LoaderdError,
)
from loaderd.wire.limits import DEFAULT_ADDRESS
from loaderd.wire.reasons import Reason, reason_of

_STATUS_ERRORS: dict[grpc.StatusCode, type[LoaderdError]] = {
    grpc.StatusCode.NOT_FOUND: DatasetNotFoundError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequestError,
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: BatchTimeoutError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceededError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
}


# A call that failed with one of these may work against another daemon, or this
# one once it is back: a loader moves the work (see loaderd.epoch.iterator) rather than raise.
_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,  # gone, restarting, draining
    grpc.StatusCode.ABORTED,  # a shared-memory session the daemon no longer knows (it restarted)
    grpc.StatusCode.CANCELLED,  # cut by the daemon's shutdown
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


def is_transient(exc: grpc.RpcError) -> bool:
    """Whether a failed call says something about the daemon's state, not about the request (or credentials)."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    return (code is None or code in _TRANSIENT) and tls_failure(exc, "") is None


def rpc_summary(exc: grpc.RpcError) -> str:
    """A failed call in one line: its code and details (for messages naming what each daemon said)."""
    if not isinstance(exc, grpc.Call):
        return str(exc)
    details = " ".join((exc.details() or "").split())
    return f"{exc.code().name}: {details}" if details else exc.code().name


_TLS_REASONS = (
    ("CERTIFICATE_VERIFY_FAILED", "its certificate is not signed by the CA this client trusts (tls['ca'])"),
    ("WRONG_VERSION_NUMBER", "it does not speak TLS on that port (a plaintext listener): drop tls= for it"),
    ("Hostname Verification", "its certificate does not name the address this client used: connect by a name it carries"),
)
_TLS_FAILURES = ("handshake failed", "verification check failed")


def tls_failure(exc: grpc.RpcError, address: str) -> AuthenticationError | None:
    """The error for a call that failed in the TLS handshake on this client's side, else None."""
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or ""
    if not any(marker in details.lower() for marker in _TLS_FAILURES):
        return None
    # Only reasons that retrying cannot fix; another failure (a reset, a proxy's alert) may pass.
    reason = next((why for key, why in _TLS_REASONS if key in details), None)
    if reason is None:
        return None
    summary = " ".join(details.split())[-300:]
    return AuthenticationError(f"cannot connect to the daemon at {address} over TLS: {reason} ({summary})")


# What to check when no daemon answers: the end of every DaemonUnavailableError a loader raises.
NO_DAEMON_HINT = (
    "Is `loaderd serve --config ...` running? A loader must use one of the addresses in its config's "
    f"`listen:` (address=..., or $LOADERD_ADDRESS; both unset means {DEFAULT_ADDRESS})"
)

# Substrings of gRPC's connect failures (from the OS's errno text), and what they mean for a user.
_UNREACHABLE = (
    ("No such file or directory", "no socket file at {path}"),
    ("Connection refused", "nothing listens there (connection refused)"),
    ("Permission denied", "no permission to connect to {path} (the daemon's unix sockets are 0600 unless its listen: entry sets socket_mode)"),
    ("DNS resolution failed", "the host name does not resolve"),
    ("Name or service not known", "the host name does not resolve"),
    ("No route to host", "no route to that host"),
    ("Network is unreachable", "no route to that host"),
    ("Socket closed", "the connection was closed at once (something other than a loaderd daemon listens there?)"),
    ("Connection reset by peer", "the connection was closed at once (something other than a loaderd daemon listens there?)"),
    ("Received http2 header with status", "something other than a loaderd daemon answers there (an HTTP server?)"),
    ("http1.x server", "an HTTP/1 server answers there, not a loaderd daemon"),
    ("Failed parsing HTTP/2", "something other than a gRPC server answers there (an HTTP/1 server?)"),
)


def explain_unreachable(exc: grpc.RpcError, address: str) -> str:
    """Why a daemon at ``address`` could not be reached, in a user's words (else the call's own summary)."""
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
    code = exc.code() if isinstance(exc, grpc.Call) else None
    path = address.removeprefix("unix://").removeprefix("unix:") if address.startswith("unix:") else address
    # Only connection failures: a daemon's own error text (UNKNOWN, INTERNAL) is quoted as it is.
    for marker, reason in _UNREACHABLE if code in (None, grpc.StatusCode.UNAVAILABLE) else ():
        if marker in details:
            return reason.format(path=path)
    if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "no answer in time (a firewall dropping packets, a wrong host, or a daemon too busy to answer)"
    return rpc_summary(exc)


def error_from_rpc(exc: grpc.RpcError, address: str) -> LoaderdError:
    """Map a failed gRPC call to the loaderd error a user can act on."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
    tls = tls_failure(exc, address)
    if tls is not None:
        return tls
    if "Received http2 header with status" in details or code == grpc.StatusCode.UNIMPLEMENTED:
        # An HTTP server, or a gRPC server without loaderd's service: a wrong address, not a loaderd error.
        summary = " ".join(details.split())[:200]
        return DaemonUnavailableError(f"{address} is not a loaderd daemon (it answered: {summary}). {NO_DAEMON_HINT}")
    cls = _STATUS_ERRORS.get(code, LoaderdError) if code is not None else LoaderdError
    if cls is DaemonUnavailableError:
        return cls(f"loaderd at {address} is unavailable: {details}")
    if cls is DatasetNotFoundError:  # which daemon said so: with several, configs can differ
        return cls(f"loaderd at {address}: {details}")
    if cls is LimitExceededError:
        # Only a request the daemon said is over a limit of its own fails everywhere alike; a daemon's
        # admission limits, and gRPC's own cap on concurrent calls (no reason attached), count calls open.
        return LimitExceededError(details, admission=reason_of(exc) is not Reason.REQUEST_LIMIT)
    return cls(details)
