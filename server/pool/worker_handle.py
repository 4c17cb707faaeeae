"""WorkerHandle: the pool's record of one worker process, from its start until it is replaced.

Written by the pool's owner thread only (``WorkerPool``'s calls); the selector's keys
carry it, so a key always says which process (which generation of a slot) it is for.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from loaderd.server.pool.result_pipe import ResultPipe
from loaderd.server.pool.task_pipe import TaskPipe


@dataclass
class WorkerHandle:
    """One worker process (generation ``generation`` of slot ``worker_id``) and the daemon's ends of its pipes."""

    worker_id: int
    process: BaseProcess
    tasks: TaskPipe
    results: ResultPipe
    generation: int
    shm_prefix: str | None
    fds: tuple[int, int]  # what the selector watches: its results pipe and its process sentinel
    ready: bool = False
    alive: bool = True
    stopped: bool = False  # stop_worker was called: never ready again, even if its WorkerReady comes after
    waiting_room: bool = False  # its task pipe's descriptor is watched for room
