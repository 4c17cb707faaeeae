"""WorkerPool: the daemon's persistent worker processes, and the messages to and from them.

Workers are forked from the pool's fork server (server/pool/fork_server.py); the pool
keeps a ``WorkerHandle`` (server/pool/worker_handle.py) for each. It only moves
messages: ``submit`` a task to a worker, ``poll`` for results and deaths,
``give_back`` a slot, ``respawn`` a dead worker, ``shutdown``. Which task goes where is the scheduler's business; how long a
shared-memory slot lives is the ledger's (server/scheduling/ledger.py).

Each worker has two pipes: tasks go down a ``TaskPipe`` (server/pool/task_pipe.py),
which any thread may send on and which never blocks; results come back on a
pipe only ``poll`` reads, through one ``PoolSelector`` (server/pool/selector.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from loaderd.server.config.schema import LoaderConfig
from loaderd.server.pool.fork_server import START_POLL_S, ForkServer, PoolStartError
from loaderd.server.pool.result_pipe import ResultPipe
from loaderd.server.pool.selector import RESULTS, ROOM, PoolSelector
from loaderd.server.pool.task_pipe import TaskPipe
from loaderd.server.pool.worker_handle import WorkerHandle
from loaderd.server.process.host_cpu import process_cpu_seconds, process_private_bytes
from loaderd.server.process.multiprocessing_private import start_child
from loaderd.server.shm.arena import worker_prefix
from loaderd.server.worker.entry import WorkerSpec, worker_main
from loaderd.server.worker.tasks import BatchDone, DatasetMeta, ReleaseSlot, Result, Task, WorkerReady, WorkerStartFailed

log = logging.getLogger("loaderd.pool")

_PAGE = os.sysconf("SC_PAGE_SIZE")
# Deferred news (a slot the worker may reuse) goes with the worker's next task; once this
# many seconds old it goes on its own at the pool's next poll (the worker's idle trim needs it).
_DEFER_S = 0.05
# Reads of one worker's results in one round at most (two groups of server/worker/result_group.py's GROUP_SIZE), beyond
# the whole results a read brought (server/pool/result_pipe.py), which are all taken.
RESULTS_PER_ROUND = 8


class PoolLostError(Exception):
    """The pool can start no worker for good (its fork server, which held the ``build: once`` datasets, is gone)."""


@dataclass(frozen=True)
class WorkerMessage:
    """A message from worker process (``worker_id``, ``generation``).

    For a ``BatchDone`` whose payload did not go to shared memory, ``buffers``
    holds the raw bytes that followed it on the pipe, by payload offset.
    """

    worker_id: int
    generation: int
    result: Result
    buffers: tuple[tuple[int, bytes], ...] = ()


@dataclass(frozen=True)
class WorkerDied:
    worker_id: int
    generation: int
    exitcode: int | None
    # The dead process's shared-memory segment names start with this (None: it had none).
    shm_prefix: str | None = None


@dataclass(frozen=True)
class WorkerState:
    """One pool slot as ``loaderd status`` shows it."""

    worker_id: int
    pid: int
    alive: bool
    ready: bool
    restarts: int


PoolEvent = WorkerMessage | WorkerDied


class WorkerPool:
    """``config.workers`` worker slots, each with a process replaceable when it dies; an elastic pool
    (``config.min_workers``) starts only its fewest, and its scheduler starts (``respawn``) and ends the others."""

    def __init__(self, config: LoaderConfig, shm_prefix: str | None, cache_prefix: str | None = None) -> None:
        """``shm_prefix``: the daemon's shared-memory name prefix (None: payloads go over pipes); ``cache_prefix``:
        its memory-tier item caches' (None: no memory cache)."""
        self.config = config
        self.size = config.workers
        self.shm_prefix = shm_prefix
        self.cache_prefix = cache_prefix
        self._fork_server = ForkServer(config)
        self._workers: dict[int, WorkerHandle] = {}
        self._generations: dict[int, int] = {}
        self.datasets: dict[str, DatasetMeta] = {}
        self.restarts = 0
        self._restarts_by_slot: dict[int, int] = {}
        self._selector = PoolSelector()

    # ------------------------------------------------------------ lifecycle

    def _spawn(self, worker_id: int) -> WorkerHandle:
        """Start worker process ``worker_id``; OSError (nothing left open) if it cannot."""
        ends: list[Connection] = []
        context = self._fork_server.context
        try:
            ends.extend(context.Pipe(duplex=False))  # tasks: (worker's read end, daemon's write end)
            ends.extend(context.Pipe(duplex=False))  # results: (daemon's read end, worker's write end)
            return self._start_process(worker_id, *ends)
        except BaseException:
            for end in ends:
                end.close()
            raise

    def _start_process(
        self, worker_id: int, task_read: Connection, task_write: Connection, recv_end: Connection, send_end: Connection
    ) -> WorkerHandle:
        generation = self._generations[worker_id] = self._generations.get(worker_id, -1) + 1
        prefix = worker_prefix(self.shm_prefix, worker_id, generation) if self.shm_prefix else None
        spec = WorkerSpec(
            worker_id=worker_id,
            pool_size=self.size,
            config=self.config,
            tasks=task_read,
            results=send_end,
            shm_prefix=prefix,
            shm_cap_bytes=self.config.shm_bytes_per_worker,
            cache_prefix=self.cache_prefix,
        )
        context = self._fork_server.context
        process = context.Process(target=worker_main, args=(spec,), name=f"loaderd-worker-{worker_id}", daemon=True)
        start_child(process)
        send_end.close()  # the worker holds the only write end: EOF here means it died
        task_read.close()  # and the only read end: a write to a dead worker fails at once
        worker = WorkerHandle(
            worker_id=worker_id,
            process=process,
            tasks=TaskPipe(task_write),
            results=ResultPipe(recv_end),
            generation=generation,
            shm_prefix=prefix,
            fds=(recv_end.fileno(), process.sentinel),
        )
        try:
            self._selector.watch(worker)
        except BaseException:
            process.kill()  # never seen by poll: nobody would reap it
            process.join(1.0)
            raise  # _spawn closes the pipes
        self._workers[worker_id] = worker
        return worker

    def start(self, timeout: float) -> dict[str, DatasetMeta]:
        """Start every worker and wait until each has built its datasets (all within ``timeout``); else
        PoolStartError, the fork server and workers gone."""
        deadline = time.monotonic() + timeout
        self._fork_server.start_workers(self._spawn, self.config.first_workers, deadline, timeout, self.shutdown)
        while not all(w.ready for w in self._workers.values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.shutdown()
                raise PoolStartError(f"workers did not build their datasets within {timeout:.0f}s")
            for event in self.poll(min(remaining, START_POLL_S)):
                if isinstance(event, WorkerDied):
                    self.shutdown()
                    raise PoolStartError(
                        f"worker {event.worker_id} died while building the datasets "
                        f"({', '.join(repr(n) for n in self.config.datasets)}) with exit code {event.exitcode}; "
                        "a dataset's constructor, __len__ or worker_init_fn ended the process (see the log above)"
                    )
                if isinstance(event.result, WorkerStartFailed):
                    self.shutdown()
                    raise PoolStartError(event.result.message)
        return self.datasets

    def respawn(self, worker_id: int) -> None:
        """Replace a dead worker; it reports WorkerReady (or WorkerStartFailed) through poll.

        OSError if no process can be started now (e.g. out of file descriptors);
        the slot stays dead and may be respawned again later. PoolLostError if no
        worker can ever start again: the fork server died, and with it the datasets it
        built once (multiprocessing would start a new one, which builds nothing, so
        each start would fail; the daemon exits for its supervisor to start it afresh).
        """
        lost = self._fork_server.lost()
        if lost is not None:
            raise PoolLostError(lost)
        old = self._workers.get(worker_id)  # None: a parked slot joining the pool
        if old is not None:
            self._close(old)
        self._spawn(worker_id)
        if old is not None:
            self.restarts += 1
            self._restarts_by_slot[worker_id] = self._restarts_by_slot.get(worker_id, 0) + 1

    def remove(self, worker_id: int) -> None:
        """Forget the slot's dead worker: it left an elastic pool (``states`` no longer lists it)."""
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._close(worker)

    def stop_worker(self, worker_id: int, kill: bool) -> int:
        """End a live worker: SIGKILL now, or (``kill=False``) once it has read everything queued to it.

        Returns its generation; its death comes through ``poll`` like any other. The worker
        is no longer ready from this call on: it takes no more tasks.
        """
        worker = self._workers[worker_id]
        worker.ready = False
        worker.stopped = True
        if worker.alive:
            if kill:
                worker.process.kill()
            else:
                try:
                    worker.tasks.send(None)
                except (ValueError, OSError):  # closed: it is dying anyway
                    pass
        return worker.generation

    def _pid(self, worker_id: int) -> int | None:
        worker = self._workers.get(worker_id)
        return worker.process.pid if worker is not None and worker.alive else None

    def cpu_seconds(self, worker_id: int) -> float | None:
        """CPU seconds the slot's worker has used (None: none there, or unknown)."""
        pid = self._pid(worker_id)
        return process_cpu_seconds(pid) if pid is not None else None

    def private_bytes(self, worker_id: int) -> int | None:
        """Memory only the slot's worker maps (None: none there, or unknown)."""
        pid = self._pid(worker_id)
        return process_private_bytes(pid) if pid is not None else None

    def rss_bytes(self, worker_id: int) -> int:
        """The worker's resident memory, from /proc (0 if it cannot be read)."""
        pid = self._pid(worker_id)
        if pid is None:
            return 0
        try:
            with open(f"/proc/{pid}/statm", "rb") as statm:
                return int(statm.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            return 0

    def states(self) -> list[WorkerState]:
        return [
            WorkerState(w.worker_id, w.process.pid or 0, w.alive, w.ready, self._restarts_by_slot.get(w.worker_id, 0))
            for w in sorted(self._workers.values(), key=lambda w: w.worker_id)
        ]

    def _close(self, worker: WorkerHandle) -> None:
        self._selector.unwatch(worker)
        worker.alive = False
        worker.ready = False
        worker.results.close()
        worker.tasks.close()

    def shutdown(self, timeout: float = 3.0) -> None:
        """Ask every worker to exit, then terminate and kill stragglers. Idempotent."""
        live = [w for w in self._workers.values() if w.alive]
        for w in live:
            try:
                w.tasks.send(None)
            except (ValueError, OSError):  # pipe already closed
                pass
        deadline = time.monotonic() + timeout
        while (running := [w for w in live if w.process.is_alive()]) and time.monotonic() < deadline:
            # A worker exits once it has read everything, None last: write what waits, and
            # take (and drop) its results, or one writing a large batch would block on its pipe.
            for w in running:
                try:
                    w.tasks.flush()
                except OSError:
                    pass
            results = {w.results.fileno(): w.results for w in running}
            for ready in wait([*results, *(w.process.sentinel for w in running)], min(0.05, max(0.0, deadline - time.monotonic()))):
                if isinstance(ready, int) and ready in results:
                    try:
                        results[ready].recv_bytes()
                    except (EOFError, OSError):
                        pass
        for w in live:
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(1.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(1.0)
            self._close(w)
        for w in self._workers.values():  # dead ones too (given up, waiting to restart): idempotent
            self._close(w)
        self._selector.close()
        self._fork_server.stop(timeout)

    # ------------------------------------------------------------ messaging

    def is_ready(self, worker_id: int) -> bool:
        worker = self._workers.get(worker_id)
        return worker is not None and worker.ready

    def submit(self, worker_id: int, task: Task) -> None:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise ValueError(f"worker slot {worker_id} has no worker")  # parked: as a dead worker's closed pipe does
        worker.tasks.send(task)

    def _receive(self, worker: WorkerHandle) -> WorkerMessage:
        result: Result = worker.results.recv()
        buffers: tuple[tuple[int, bytes], ...] = ()
        if isinstance(result, BatchDone) and result.slot is None:
            buffers = tuple((offset, worker.results.recv_bytes()) for offset in result.buffer_offsets)
        elif isinstance(result, WorkerReady):
            worker.ready = not worker.stopped
            if not self.datasets and result.imported:  # the pool's first ready worker says it, once
                self._warn_imported(result.imported)
            self.datasets = self.datasets or result.datasets
        return WorkerMessage(worker.worker_id, worker.generation, result, buffers)

    def _warn_imported(self, packages: tuple[str, ...]) -> None:
        modules = self.config.modules
        log.warning(
            "building the datasets imported %s in each pool worker, after the fork server had imported the config's modules (%s): "
            "every worker holds its own copy of them (torchvision alone is ~75 MiB). Import them at the top of those modules, "
            "where the fork server imports them once for every worker, or build the dataset once (build: once)",
            ", ".join(packages),
            ", ".join(modules),
        )

    def give_back(self, worker_id: int, generation: int, name: str) -> None:
        """Tell worker process (``worker_id``, ``generation``) it may reuse segment ``name``; no-op if it is gone."""
        worker = self._workers.get(worker_id)
        if worker is None or not worker.alive or worker.generation != generation:
            return
        try:
            # Needed only before the worker's next task: it goes with that task (or the next poll).
            worker.tasks.defer(ReleaseSlot(name))
        except (ValueError, OSError):  # closed: the worker died meanwhile
            pass

    def _flush(self, worker: WorkerHandle) -> None:
        """Write what waits for room in the worker's pipe, and deferred news once old enough."""
        try:
            worker.tasks.flush(_DEFER_S)
        except OSError:  # the worker is gone: its death comes through its sentinel
            pass

    def poll(self, timeout: float, extra: Sequence[Any] = ()) -> list[PoolEvent]:
        """Wait up to ``timeout`` for results or deaths (or for any of ``extra`` to be ready).

        Tasks that did not fit in a worker's pipe go as soon as it has room; deferred
        news waits at most ``_DEFER_S`` past its age limit."""
        live = [w for w in self._workers.values() if w.alive]
        for w in live:
            if w.tasks.pending:
                self._flush(w)
            if w.tasks.deferred:
                timeout = min(timeout, _DEFER_S)
            self._selector.watch_room(w)
        self._selector.watch_extra(extra)
        # Whole results a read brought and a round left (it failed on an earlier one): the selector sees only the
        # pipes, and an idle worker writes nothing more. They are taken now, without waiting.
        buffered = [w for w in live if w.results.whole()]
        selected = self._selector.select(0.0 if buffered else timeout)
        reported = {id(watched[0]) for watched in selected if watched is not None and watched[1] is RESULTS}
        selected += [(w, RESULTS) for w in buffered if id(w) not in reported]
        events: list[PoolEvent] = []
        died: list[WorkerHandle] = []
        for watched in selected:
            if watched is None:  # one of ``extra``: the caller looks at it
                continue
            worker, kind = watched
            if not worker.alive or worker in died:
                continue
            if kind is ROOM:
                self._flush(worker)
            elif kind is RESULTS:
                try:
                    # Every whole result a worker wrote together (server/worker/result_group.py), up to
                    # ``RESULTS_PER_ROUND`` read from the pipe (the selector is level-triggered: more come next
                    # round), and every whole one a read brought (the selector cannot see those).
                    events.append(self._receive(worker))
                    taken = 1
                    while worker.results.whole() or (taken < RESULTS_PER_ROUND and worker.results.readable()):
                        events.append(self._receive(worker))
                        taken += 1
                except (EOFError, OSError):
                    died.append(worker)
            else:
                died.append(worker)
        for worker in died:
            if not worker.alive:
                continue
            # Take what the worker finished before it died, then declare it dead.
            try:
                while worker.results.pending():
                    events.append(self._receive(worker))
            except (EOFError, OSError):
                pass
            self._selector.unwatch(worker)
            worker.process.join(0.1)
            worker.alive = False
            worker.ready = False
            events.append(WorkerDied(worker.worker_id, worker.generation, worker.process.exitcode, worker.shm_prefix))
        return events
