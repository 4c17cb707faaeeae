"""loaderd: a data-loading daemon for PyTorch, and its client ``RemoteDataLoader``."""

from loaderd.errors import (
    BatchTimeoutError,
    ConfigOnlyArgumentError,
    DaemonUnavailableError,
    DatasetNotFoundError,
    InvalidRequestError,
    LoaderdError,
    RemoteWorkerError,
    TransportError,
    WorkerCrashedError,
)
from loaderd.loader import RemoteDataLoader

__all__ = [
    "BatchTimeoutError",
    "ConfigOnlyArgumentError",
    "DaemonUnavailableError",
    "DatasetNotFoundError",
    "InvalidRequestError",
    "LoaderdError",
    "RemoteDataLoader",
    "RemoteWorkerError",
    "TransportError",
    "WorkerCrashedError",
]
