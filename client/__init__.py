"""loaderd: a data-loading daemon for PyTorch, and its client ``RemoteDataLoader``.

``RemoteDataLoader`` (and with it torch) is imported on first use, not by
``import loaderd``: the daemon's own modules live in this package too, and the
daemon never imports torch (see server/worker/import_check.py).
"""

from typing import TYPE_CHECKING, Any

from loaderd.errors import (
    AuthenticationError,
    BatchTimeoutError,
    ConfigOnlyArgumentError,
    CredentialsError,
    DaemonMismatchError,
    DaemonUnavailableError,
    DatasetNotFoundError,
    InvalidRequestError,
    LimitExceededError,
    LoaderdError,
    RemoteWorkerError,
    TransportError,
    WorkerCrashedError,
)

if TYPE_CHECKING:
    from loaderd.loader.data_loader import RemoteDataLoader

__all__ = [
    "AuthenticationError",
    "BatchTimeoutError",
    "ConfigOnlyArgumentError",
    "CredentialsError",
    "DaemonMismatchError",
    "DaemonUnavailableError",
    "DatasetNotFoundError",
    "InvalidRequestError",
    "LimitExceededError",
    "LoaderdError",
    "RemoteDataLoader",
    "RemoteWorkerError",
    "TransportError",
    "WorkerCrashedError",
]

if not TYPE_CHECKING:  # type checkers see the import above, and attribute typos stay errors

    def __getattr__(name: str) -> Any:
        """``loaderd.RemoteDataLoader``, imported (with torch) the first time it is asked for."""
        if name != "RemoteDataLoader":
            raise AttributeError(f"module 'loaderd' has no attribute {name!r}")
        from loaderd.loader.data_loader import RemoteDataLoader

        globals()["RemoteDataLoader"] = RemoteDataLoader  # asked for once
        return RemoteDataLoader


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
