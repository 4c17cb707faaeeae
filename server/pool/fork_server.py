"""ForkServer: the fork server the pool's workers are forked from, and their first start through it.

The fork server is started (with torch and the config's modules preloaded, and the
``build: once`` datasets built) before any gRPC server exists, so replacing a dead
worker later never forks a process that runs gRPC threads. multiprocessing keeps one
fork server per process: the pool's first worker start starts it (``start_workers``),
``stop`` ends it, and ``lost`` tells whether the one this pool started died with the
datasets it built once. Called on the daemon's thread that owns the pool.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
import time
from collections.abc import Callable

from loaderd.server.config.schema import LoaderConfig
from loaderd.server.process import glibc_tunables
from loaderd.server.process.multiprocessing_private import (
    fork_server_alive,
    fork_server_environment,
    fork_server_pid,
    stop_fork_server,
)
from loaderd.server.worker import prebuilt

# How often a starting pool re-checks its deadline (and, in WorkerPool.start, reads its workers' news).
START_POLL_S = 0.05


class PoolStartError(Exception):
    """A worker could not build the config's datasets; the message says which and why."""


class ForkServer:
    """The multiprocessing context the pool's workers start from (``context``), and its fork server."""

    def __init__(self, config: LoaderConfig) -> None:
        self.config = config
        self.context = mp.get_context("forkserver")
        # build_once imports the config's modules in the fork server (once for the pool, under the
        # config's python_path, which 3.11's fork server would not apply; a module that raises is left
        # to the workers and the daemon's import check to report, where multiprocessing's own preload
        # would end the fork server with a traceback) and builds the ``build: once`` datasets.
        self.context.set_forkserver_preload(["torch", "numpy", "loaderd.server.worker.worker", "loaderd.server.worker.build_once"])
        self.build_once = [s for s in config.datasets.values() if s.build == "once"]
        self._pid: int | None = None  # the fork server this pool started (None until its start succeeded)

    def start_workers(
        self,
        spawn: Callable[[int], object],
        count: int,
        deadline: float,
        timeout: float,
        shutdown: Callable[[], None],
    ) -> None:
        """Start worker processes 0 to ``count - 1`` (``spawn(worker_id)``), giving up at ``deadline``;
        PoolStartError, once ``shutdown`` ended what started, if they did not start.

        Starting the first process waits (without a timeout) for the fork server to
        finish its preloads: the config's modules, and with ``build: once`` building
        its datasets; a module or constructor that hangs would hang the daemon. So
        the starts run on a thread, which checks ``halt`` before each one; to give
        up, ``halt`` is set (no later start would launch a second fork server) and
        the fork server is killed, which ends the start waiting on it.
        """
        names = ", ".join(repr(s.name) for s in self.build_once)
        if self.build_once and fork_server_pid() is not None:
            # Its preloads ran already (another pool of this process): it would build nothing.
            raise PoolStartError(f"build: once ({names}) needs a fork server of its own; this process has one already")
        failure: list[BaseException] = []
        halt = threading.Event()

        def spawn_all() -> None:
            try:
                for worker_id in range(count):
                    if halt.is_set():
                        return
                    spawn(worker_id)
            except BaseException as exc:  # noqa: BLE001 - reported below, on the daemon's thread
                failure.append(exc)

        # Every module the config names: what the fork server imports, its workers share (and need not import again).
        modules = self.config.modules
        tunables = os.environ.get(glibc_tunables.VARIABLE)
        log_setup = (self.config.log_level, self.config.log_format)
        try:
            path = prebuilt.write_payload(prebuilt.Payload(self.build_once, self.config.python_path, modules, log_setup, tunables))
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
        thread = threading.Thread(target=spawn_all, name="loaderd-pool-start", daemon=True)
        with fork_server_environment(environment):  # the variables leave with the block
            try:
                thread.start()
                while thread.is_alive() and not stopped:
                    thread.join(max(0.0, min(START_POLL_S, deadline - time.monotonic())))
                    if time.monotonic() >= deadline and thread.is_alive():
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
                    shutdown()  # stops a fork server that a start racing the halt launched again, too
                os.unlink(path)
        if stopped:
            raise PoolStartError(stopped)
        if failure:
            # E.g. a module or constructor that ended the fork server (os._exit, a crash, the OOM
            # killer): the start then fails with EOFError, which says nothing of the dataset.
            shutdown()
            during = f" while the fork server built the datasets with build: once ({names})" if names else ""
            raise PoolStartError(
                f"a worker could not start{during}: {type(failure[0]).__name__}: {failure[0]} (a module or "
                "constructor that ends its process, e.g. out of memory, ends the fork server; or no process "
                "could be started; see the log above)"
            )
        self._pid = fork_server_pid()

    def lost(self) -> str | None:
        """Why no worker can ever start again, or None: with ``build: once`` datasets, the fork server
        this pool started died, and with them (multiprocessing would start a new one, which builds
        nothing, so each start would fail; the daemon exits for its supervisor to start it afresh)."""
        if not self.build_once or fork_server_alive(self._pid):
            return None
        names = ", ".join(repr(s.name) for s in self.build_once)
        return (
            f"the pool's fork server (pid {self._pid}) died, and with it the datasets it built "
            f"once ({names}); a new daemon must build them again (killed by the OOM killer? see the kernel log)"
        )

    @staticmethod
    def stop(timeout: float) -> None:
        """Stop and reap this process's fork server (killed if it has not exited within ``timeout``). Idempotent."""
        stop_fork_server(timeout)
