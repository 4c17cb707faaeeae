"""WorkerPool: the daemon's persistent worker processes.

Workers are forked from a fork server that is started (with torch and the
config's modules preloaded) before any gRPC server exists, so replacing a dead
worker later never forks a process that runs gRPC threads.

The pool only moves messages: ``submit`` a task to a worker, ``poll`` for
results and deaths, ``give_back`` a slot, ``respawn`` a dead worker,
``shutdown``. Which task goes where is the scheduler's business; how long a
shared-memory slot lives is the ledger's (server/scheduling/ledger.py).

Each worker has two pipes: tasks go down a ``TaskPipe`` (server/pool/task_pipe.py),
which any thread may send on and which never blocks; results come back on a
pipe only ``poll`` reads, through one selector kept for the pool's life.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import selectors
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from loaderd.server.config.schema import LoaderConfig
from loaderd.server.pool.task_pipe import TaskPipe
from loaderd.server.process import glibc_tunables
from loaderd.server.process.multiprocessing_private import (
    fork_server_alive,
    fork_server_environment,
    fork_server_pid,
    start_child,
    stop_fork_server,
)
from loaderd.server.shm.arena import worker_prefix
from loaderd.server.worker import prebuilt
from loaderd.server.worker.entry import WorkerSpec, worker_main
from loaderd.server.worker.tasks import BatchDone, DatasetMeta, ReleaseSlot, Result, Task, WorkerReady, WorkerStartFailed

log = logging.getLogger("loaderd.pool")

_PAGE = os.sysconf("SC_PAGE_SIZE")
# Deferred news (a slot the worker may reuse) goes with the worker's next task; once this
# many seconds old it goes on its own at the pool's next poll (the worker's idle trim needs it).
_DEFER_S = 0.05
# How often a starting pool asks whether to give up (the daemon's import check may fail meanwhile).
_START_POLL_S = 0.05
# What a selector key of the pool is for (its data is (worker, one of these)).
_RESULTS, _DIED, _ROOM = "results", "died", "room"


class PoolStartError(Exception):
    """A worker could not build the config's datasets; the message says which and why."""


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


@dataclass
class _Worker:
    worker_id: int
    process: BaseProcess
    tasks: TaskPipe
    results: Connection
    generation: int
    shm_prefix: str | None
    fds: tuple[int, int]  # what the selector watches: its results pipe and its process sentinel
    ready: bool = False
    alive: bool = True
    stopped: bool = False  # stop_worker was called: never ready again, even if its WorkerReady comes after
    waiting_room: bool = False  # its task pipe's descriptor is watched for room


class WorkerPool:
    """A fixed number of worker processes, each replaceable when it dies."""

    def __init__(self, config: LoaderConfig, shm_prefix: str | None) -> None:
        """``shm_prefix``: the daemon's shared-memory name prefix (None: payloads go over pipes)."""
        self.config = config
        self.size = config.workers
        self.shm_prefix = shm_prefix
        self._ctx = mp.get_context("forkserver")
        # build_once imports the config's modules in the fork server (once for the pool, under the
        # config's python_path, which 3.11's fork server would not apply; a module that raises is left
        # to the workers and the daemon's import check to report, where multiprocessing's own preload
        # would end the fork server with a traceback) and builds the ``build: once`` datasets.
        self._ctx.set_forkserver_preload(["torch", "numpy", "loaderd.server.worker.worker", "loaderd.server.worker.build_once"])
        self._build_once = [s for s in config.datasets.values() if s.build == "once"]
        self._fork_server_pid: int | None = None  # the fork server this pool started (None until its start succeeded)
        self._workers: dict[int, _Worker] = {}
        self._generations: dict[int, int] = {}
        self.datasets: dict[str, DatasetMeta] = {}
        self.restarts = 0
        self._restarts_by_slot: dict[int, int] = {}
        # Kept across polls (building a selector per round cost a fifth of the scheduler's time):
        # each live worker's results pipe and process sentinel, and poll's ``extra`` objects.
        self._selector = selectors.DefaultSelector()
        self._extra: dict[int, Any] = {}

    # ------------------------------------------------------------ lifecycle

    def _spawn(self, worker_id: int) -> _Worker:
        """Start worker process ``worker_id``; OSError (nothing left open) if it cannot."""
        ends: list[Connection] = []
        try:
            ends.extend(self._ctx.Pipe(duplex=False))  # tasks: (worker's read end, daemon's write end)
            ends.extend(self._ctx.Pipe(duplex=False))  # results: (daemon's read end, worker's write end)
            return self._start_process(worker_id, *ends)
        except BaseException:
            for end in ends:
                end.close()
            raise

    def _start_process(
        self, worker_id: int, task_read: Connection, task_write: Connection, recv_end: Connection, send_end: Connection
    ) -> _Worker:
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
        )
        process = self._ctx.Process(target=worker_main, args=(spec,), name=f"loaderd-worker-{worker_id}", daemon=True)
        start_child(process)
        send_end.close()  # the worker holds the only write end: EOF here means it died
        task_read.close()  # and the only read end: a write to a dead worker fails at once
        worker = _Worker(
            worker_id=worker_id,
            process=process,
            tasks=TaskPipe(task_write),
            results=recv_end,
            generation=generation,
            shm_prefix=prefix,
            fds=(recv_end.fileno(), process.sentinel),
        )
        try:
            self._selector.register(worker.fds[0], selectors.EVENT_READ, (worker, _RESULTS))
            self._selector.register(worker.fds[1], selectors.EVENT_READ, (worker, _DIED))
        except BaseException:
            self._unwatch(worker)
            process.kill()  # never seen by poll: nobody would reap it
            process.join(1.0)
            raise  # _spawn closes the pipes
        self._workers[worker_id] = worker
        return worker

    def start(self, timeout: float, give_up: Callable[[], str | None] = lambda: None) -> dict[str, DatasetMeta]:
        """Start every worker and wait until each has built its datasets (all within ``timeout``).

        ``give_up`` is asked every few tens of milliseconds meanwhile; once it returns a
        reason, the start stops (fork server and workers go) with a PoolStartError
        saying it. The daemon passes its import check's verdict, which runs meanwhile.
        """
        deadline = time.monotonic() + timeout
        self._spawn_all(deadline, timeout, give_up)
        while not all(w.ready for w in self._workers.values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.shutdown()
                raise PoolStartError(f"workers did not build their datasets within {timeout:.0f}s")
            reason = give_up()
            if reason:
                self.shutdown()
                raise PoolStartError(f"pool start stopped: {reason}")
            for event in self.poll(min(remaining, _START_POLL_S)):
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

    def _spawn_all(self, deadline: float, timeout: float, give_up: Callable[[], str | None]) -> None:
        """Start every worker process, giving up at ``deadline`` or when ``give_up`` says so.

        Starting the first process waits (without a timeout) for the fork server to
        finish its preloads: the config's modules, and with ``build: once`` building
        its datasets; a module or constructor that hangs would hang the daemon. So
        the starts run on a thread, which checks ``halt`` before each one; to give
        up, ``halt`` is set (no later start would launch a second fork server) and
        the fork server is killed, which ends the start waiting on it.
        """
        names = ", ".join(repr(s.name) for s in self._build_once)
        if self._build_once and fork_server_pid() is not None:
            # Its preloads ran already (another pool of this process): it would build nothing.
            raise PoolStartError(f"build: once ({names}) needs a fork server of its own; this process has one already")
        failure: list[BaseException] = []
        halt = threading.Event()

        def spawn() -> None:
            try:
                for worker_id in range(self.size):
                    if halt.is_set():
                        return
                    self._spawn(worker_id)
            except BaseException as exc:  # noqa: BLE001 - reported below, on the daemon's thread
                failure.append(exc)

        modules = sorted({s.factory.partition(":")[0] for s in self.config.datasets.values()})
        tunables = os.environ.get(glibc_tunables.VARIABLE)
        log_setup = (self.config.log_level, self.config.log_format)
        try:
            path = prebuilt.write_payload(prebuilt.Payload(self._build_once, self.config.python_path, modules, log_setup, tunables))
        except (OSError, pickle.PicklingError) as exc:
            raise PoolStartError(f"could not write the fork server's start file: {exc}") from None
        # The variable names the payload while workers start (the fork server reads the file
        # once, before its first fork, and drops the variable); neither outlives this call.
        environment = {prebuilt.ENV: path}
        # The fork server (and so every worker) copies batches into slots past the cache; it puts
        # the variable back as ``tunables`` for what workers start, and so does this call, after.
        fork_server_tunables = glibc_tunables.fork_server_value(tunables)
        if fork_server_tunables is not None:
            environment[glibc_tunables.VARIABLE] = fork_server_tunables
        stopped = ""
        thread = threading.Thread(target=spawn, name="loaderd-pool-start", daemon=True)
        with fork_server_environment(environment):  # the variables leave with the block
            try:
                thread.start()
                while thread.is_alive() and not stopped:
                    thread.join(max(0.0, min(_START_POLL_S, deadline - time.monotonic())))
                    reason = give_up()
                    if reason:
                        stopped = f"pool start stopped: {reason}"
                    elif time.monotonic() >= deadline and thread.is_alive():
                        what = f"build the datasets with build: once ({names})" if names else "import the config's modules"
                        stopped = f"the fork server did not {what} within {timeout:.0f}s"
            except BaseException:  # e.g. KeyboardInterrupt in a program that starts a pool itself
                stopped = "interrupted"
                raise
            finally:
                if stopped:
                    halt.set()
                    stop_fork_server(0.0)
                    if thread.is_alive():
                        thread.join(10.0)
                    self.shutdown()  # stops a fork server that a start racing the halt launched again, too
                os.unlink(path)
        if stopped:
            raise PoolStartError(stopped)
        if failure:
            # E.g. a module or constructor that ended the fork server (os._exit, a crash, the OOM
            # killer): the start then fails with EOFError, which says nothing of the dataset.
            self.shutdown()
            during = f" while the fork server built the datasets with build: once ({names})" if names else ""
            raise PoolStartError(
                f"a worker could not start{during}: {type(failure[0]).__name__}: {failure[0]} (a module or "
                "constructor that ends its process, e.g. out of memory, ends the fork server; or no process "
                "could be started; see the log above)"
            )
        self._fork_server_pid = fork_server_pid()

    def respawn(self, worker_id: int) -> None:
        """Replace a dead worker; it reports WorkerReady (or WorkerStartFailed) through poll.

        OSError if no process can be started now (e.g. out of file descriptors);
        the slot stays dead and may be respawned again later. PoolLostError if no
        worker can ever start again: the fork server died, and with it the datasets it
        built once (multiprocessing would start a new one, which builds nothing, so
        each start would fail; the daemon exits for its supervisor to start it afresh).
        """
        if self._build_once and not fork_server_alive(self._fork_server_pid):
            names = ", ".join(repr(s.name) for s in self._build_once)
            raise PoolLostError(
                f"the pool's fork server (pid {self._fork_server_pid}) died, and with it the datasets it built "
                f"once ({names}); a new daemon must build them again (killed by the OOM killer? see the kernel log)"
            )
        old = self._workers[worker_id]
        self._close(old)
        self._spawn(worker_id)
        self.restarts += 1
        self._restarts_by_slot[worker_id] = self._restarts_by_slot.get(worker_id, 0) + 1

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

    def rss_bytes(self, worker_id: int) -> int:
        """The worker's resident memory, from /proc (0 if it cannot be read)."""
        pid = self._workers[worker_id].process.pid
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

    def _unwatch(self, worker: _Worker) -> None:
        """Stop polling a dead worker's descriptors (its pipe and sentinel stay readable for ever). Idempotent.

        By number, and only keys that are this worker's: a descriptor closed meanwhile may
        have been reused by another worker's."""
        keys = self._selector.get_map()
        if keys is None:  # closed at shutdown
            return
        for fd in (*worker.fds, worker.tasks.fileno()):
            key = keys.get(fd)
            if key is not None and key.data is not None and key.data[0] is worker:
                self._selector.unregister(fd)
        worker.waiting_room = False

    def _watch_room(self, worker: _Worker) -> None:
        """Watch the worker's task pipe for room exactly while bytes wait for it."""
        want = worker.tasks.unsent
        if want and not worker.waiting_room:
            self._selector.register(worker.tasks.fileno(), selectors.EVENT_WRITE, (worker, _ROOM))
        elif worker.waiting_room and not want:
            self._selector.unregister(worker.tasks.fileno())
        worker.waiting_room = want

    def _close(self, worker: _Worker) -> None:
        self._unwatch(worker)
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
            results = {w.results: w for w in running}
            for ready in wait([*results, *(w.process.sentinel for w in running)], min(0.05, max(0.0, deadline - time.monotonic()))):
                if ready in results:
                    try:
                        ready.recv_bytes()
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
        self._extra.clear()
        self._selector.close()  # its epoll descriptor; a closed selector closes again quietly
        stop_fork_server(timeout)

    # ------------------------------------------------------------ messaging

    def is_ready(self, worker_id: int) -> bool:
        return self._workers[worker_id].ready

    def submit(self, worker_id: int, task: Task) -> None:
        self._workers[worker_id].tasks.send(task)

    def _receive(self, worker: _Worker) -> WorkerMessage:
        result: Result = worker.results.recv()
        buffers: tuple[tuple[int, bytes], ...] = ()
        if isinstance(result, BatchDone) and result.slot is None:
            buffers = tuple((offset, worker.results.recv_bytes()) for offset in result.buffer_offsets)
        elif isinstance(result, WorkerReady):
            worker.ready = not worker.stopped
            self.datasets = self.datasets or result.datasets
        return WorkerMessage(worker.worker_id, worker.generation, result, buffers)

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

    def _watch_extra(self, extra: Sequence[Any]) -> None:
        """Poll exactly ``extra`` besides the workers (the scheduler passes the same wake-up pipe each round)."""
        wanted = {id(obj): obj for obj in extra}
        if wanted.keys() == self._extra.keys():
            return
        for key in self._extra.keys() - wanted.keys():
            self._selector.unregister(self._extra.pop(key))
        for key in wanted.keys() - self._extra.keys():
            self._selector.register(wanted[key], selectors.EVENT_READ, None)
            self._extra[key] = wanted[key]

    def _flush(self, worker: _Worker) -> None:
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
            self._watch_room(w)
        self._watch_extra(extra)
        events: list[PoolEvent] = []
        died: list[_Worker] = []
        for key, _ in self._selector.select(timeout):
            if key.data is None:  # one of ``extra``: the caller looks at it
                continue
            worker, kind = key.data
            if not worker.alive or worker in died:
                continue
            if kind is _ROOM:
                self._flush(worker)
            elif kind is _RESULTS:
                try:
                    # One message a round: the selector is level-triggered, so more come next round
                    # (``Connection.poll`` would build a selector of its own per call).
                    events.append(self._receive(worker))
                except (EOFError, OSError):
                    died.append(worker)
            else:
                died.append(worker)
        for worker in died:
            if not worker.alive:
                continue
            # Take what the worker finished before it died, then declare it dead.
            try:
                while worker.results.poll(0):
                    events.append(self._receive(worker))
            except (EOFError, OSError):
                pass
            self._unwatch(worker)
            worker.process.join(0.1)
            worker.alive = False
            worker.ready = False
            events.append(WorkerDied(worker.worker_id, worker.generation, worker.process.exitcode, worker.shm_prefix))
        return events
