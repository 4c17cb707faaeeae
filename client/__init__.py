"""loaderd: a data-loading daemon for PyTorch, and its client ``RemoteDataLoader``."""

import gc

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

# Everything imported so far (torch, numpy, grpc, loaderd) lives as long as the
# process: move it to the collector's permanent generation. Otherwise the first
# full collection rescans torch's whole import heap (~90 ms on the development
# machine) at a moment chosen by allocation counts, typically inside a fresh
# process's first RemoteDataLoader or its first batch (tests/bench/bench_loaders.py
# "fresh client process"). Objects made later are collected as usual.
gc.freeze()
