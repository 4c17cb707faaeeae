"""Every error loaderd raises, and how a user's exception crosses process boundaries.

A worker process turns a user exception into a ``RemoteError`` message
(:func:`capture_exception`), and the client turns that message back into an
exception of the original type where it can (:func:`exception_from_remote`).
Failed gRPC calls become these errors in one other place, loaderd.channel.rpc_errors:
this module imports no grpc, so the pool's fork server and workers, which need
the classes and ``capture_exception``, do not load it (~2 MB a process tree).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

from loaderd.v1 import loaderd_pb2 as pb
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
    """The daemon refused a request over one of its limits (the config's ``limits:``); the message names it.

    ``admission``: the limit counts calls the daemon has open (``max_streams``, ``max_sessions``,
    ``max_streams_per_client``), so another daemon, or this one later, may take the call; else the
    request itself is over a limit, and every daemon refuses it alike.
    """

    def __init__(self, message: str = "", *, admission: bool = False) -> None:
        super().__init__(message)
        self.admission = admission


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
    except Exception as exc:  # noqa: BLE001 - a __str__ that raises must not take the worker down with it
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


def _resolve_exception_type(module: str, qualname: str) -> type[Exception] | None:
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
        except Exception:  # noqa: BLE001 - a constructor that wants other arguments
            pass
    remote = RemoteWorkerError(f"{err.type_module}.{err.type_qualname}: {message}")
    remote.remote_type = f"{err.type_module}.{err.type_qualname}"  # type: ignore[attr-defined]  # an attribute of this instance only (the remote class's name)
    return remote
