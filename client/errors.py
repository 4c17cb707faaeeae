"""Every error loaderd raises, and the one place where errors are translated.

Errors cross two boundaries as data: a worker process turns a user exception
into a ``RemoteError`` message (:func:`capture_exception`), and the client turns
that message back into an exception of the original type where it can
(:func:`exception_from_remote`) and gRPC status codes into loaderd errors
(:func:`error_from_rpc`).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import grpc

from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.limits import DEFAULT_ADDRESS
from loaderd.wire.names import find_loaded


class LoaderdError(Exception):
    """Base class of every error loaderd itself raises."""


class DaemonUnavailableError(LoaderdError, ConnectionError):
    """The daemon could not be reached, or went away mid-stream."""


class DatasetNotFoundError(LoaderdError, LookupError):
    """The daemon's config defines no dataset of that name."""


class InvalidRequestError(LoaderdError, ValueError):
    """The daemon rejected a request as malformed."""


class ConfigOnlyArgumentError(LoaderdError, ValueError):
    """A DataLoader argument that names code: it belongs in the daemon's config."""


class BatchTimeoutError(LoaderdError, TimeoutError):
    """A batch was not delivered within the loader's ``timeout``."""


class RemoteWorkerError(LoaderdError, RuntimeError):
    """User code failed in the daemon with an exception type the client cannot rebuild."""


class WorkerCrashedError(LoaderdError, RuntimeError):
    """A pool worker died (signal, segfault) every time it ran a batch."""


class TransportError(LoaderdError, ValueError):
    """A batch cannot be encoded for, or decoded from, the wire."""


class DaemonMismatchError(LoaderdError):
    """Two daemons a loader uses serve its dataset differently (kind or length); the message names both."""


class LimitExceededError(LoaderdError):
    """The daemon refused a request over one of its limits (the config's ``limits:``); the message names it."""


class AuthenticationError(LoaderdError, PermissionError):
    """The daemon did not accept this client's credentials (token, certificate) or refused it an action.

    Raised at once: retrying with the same credentials cannot help.
    """


class CredentialsError(LoaderdError, ValueError):
    """The ``tls``/``token`` arguments (or their environment variables) cannot be used; the message says which."""


class _KeyErrorMessage(str):
    """KeyError reprs its message; keep the remote traceback readable (as torch does)."""

    def __repr__(self) -> str:
        return self


# ----------------------------------------------------------- worker side


# Bounds on what an error carries: user code controls the text, and it is
# echoed into the daemon's log and every reply (a 100 MB message must not be).
MAX_ERROR_MESSAGE = 4096
MAX_ERROR_TRACEBACK = 32768
_U64 = (1 << 64) - 1


def clip(text: str, limit: int, *, keep_end: bool = False) -> str:
    """``text`` cut to about ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    cut = f" [... {len(text) - limit} characters cut ...] "
    return cut + text[-limit:] if keep_end else text[:limit] + cut


def _text(render: Callable[[], str]) -> str:
    try:
        return render()
    except Exception as exc:  # a __str__ that raises must not take the worker down with it
        return f"<unprintable: {type(exc).__name__}>"


def _format(exc: BaseException) -> str:
    # Each part (a frame, the final "Type: message" line) bounded on its own, so a huge message cannot push the frames out.
    return "".join(clip(part, MAX_ERROR_MESSAGE) for part in traceback.format_exception(exc))


def capture_exception(exc: BaseException, where: str, seq: int = 0) -> pb.RemoteError:
    """Turn an exception raised by user code into wire data. Never raises; texts are bounded."""
    cls = type(exc)
    return pb.RemoteError(
        seq=seq if 0 <= seq <= _U64 else 0,
        type_module=clip(str(cls.__module__), 256),
        type_qualname=clip(str(cls.__qualname__), 256),
        message=clip(_text(lambda: str(exc)), MAX_ERROR_MESSAGE),
        # The end of a traceback is where it happened: keep that.
        traceback=clip(_text(lambda: _format(exc)), MAX_ERROR_TRACEBACK, keep_end=True),
        where=clip(where, 1024),
    )


# ----------------------------------------------------------- client side


def _resolve_exception_type(module: str, qualname: str) -> type[BaseException] | None:
    """The remote exception's class, if the client already imported it (nothing is imported on the server's say-so)."""
    owner = find_loaded(module, qualname)
    if isinstance(owner, type) and issubclass(owner, Exception):
        return owner
    return None


def exception_from_remote(err: pb.RemoteError) -> Exception:
    """Rebuild a worker's exception with the remote traceback in its message."""
    message = f"Caught {err.type_qualname} {err.where}.\nOriginal {err.traceback}"
    cls = _resolve_exception_type(err.type_module, err.type_qualname)
    if cls is not None:
        try:
            return cls(_KeyErrorMessage(message) if issubclass(cls, KeyError) else message)
        except Exception:  # a constructor that wants other arguments
            pass
    remote = RemoteWorkerError(f"{err.type_module}.{err.type_qualname}: {message}")
    remote.remote_type = f"{err.type_module}.{err.type_qualname}"  # type: ignore[attr-defined]
    return remote


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
# one once it is back: a loader moves the work (see loaderd.iterator) rather than raise.
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
    return cls(details)
