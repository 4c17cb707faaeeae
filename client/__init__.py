"""loaderd: a data-loading daemon for PyTorch, and its client ``RemoteDataLoader``.

``RemoteDataLoader`` (and with it torch) is imported on first use, not by
``import loaderd``: the daemon's own modules live in this package too, and the
daemon never imports torch (see server/import_check.py).
"""

import gc
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
    from loaderd.loader import RemoteDataLoader

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



def __getattr__(name: str) -> Any:
    """``loaderd.RemoteDataLoader``, imported (with torch) the first time it is asked for."""
    if name != "RemoteDataLoader":
        raise AttributeError(f"module 'loaderd' has no attribute {name!r}")
    from loaderd.loader import RemoteDataLoader

    globals()["RemoteDataLoader"] = RemoteDataLoader  # asked for once
    # Everything imported so far (torch, numpy, grpc, loaderd) lives as long as the
    # process: move it to the collector's permanent generation. Otherwise the first
    # full collection rescans torch's whole import heap (~90 ms on the development
    # machine) at a moment chosen by allocation counts, typically inside a fresh
    # process's first RemoteDataLoader or its first batch (tests/bench/bench_loaders.py
    # "fresh client process"). Objects made later are collected as usual.
    gc.freeze()
    return RemoteDataLoader
