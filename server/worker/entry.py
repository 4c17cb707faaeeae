"""What a pool worker process is started with: its frozen spec and its entry point.

The daemon imports this module, never ``loaderd.server.worker.worker`` (which imports
torch and the datasets' code): the fork server preloads that module, so the
entry point's import of it costs a worker nothing, and the daemon stays small.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection

from loaderd.server.config.schema import LoaderConfig


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs, fixed at spawn time."""

    worker_id: int
    pool_size: int
    config: LoaderConfig
    tasks: Connection  # read end: Task | None (server/pool/task_pipe.py writes it)
    results: Connection
    # Name prefix of this worker's shared-memory segments; None sends payloads over the pipe.
    shm_prefix: str | None
    shm_cap_bytes: int
    # Name prefix of the memory tier's item caches in /dev/shm (server/cache/item_store.py), the daemon's to remove.
    cache_prefix: str | None = None


def worker_main(spec: WorkerSpec) -> None:
    """Worker process entry point (the body is ``loaderd.server.worker.worker.run_worker``)."""
    from loaderd.server.worker.worker import run_worker

    run_worker(spec)
