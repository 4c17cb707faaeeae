"""Everything loaderd does with multiprocessing beyond its public API, in this one module.

The pool runs on multiprocessing's fork server: started before any gRPC thread, it imports
torch and the config's modules once (and builds ``build: once`` datasets), and forks every
worker from that warm state. Four things it needs are not in multiprocessing's public API:

1. Starting a child without it re-running ``__main__`` (``start_child``, below).
2. The fork server's pid and liveness pipe, to tell whether the one that built the datasets
   still runs (``fork_server_pid``, ``fork_server_alive``), and to stop and reap it with a
   timeout (``stop_fork_server``: multiprocessing's own waits for ever).
3. A worker closing its inherited copy of that liveness pipe (``drop_fork_server_handle``), so a
   SIGKILLed daemon's fork server and workers see EOF and exit.
4. Handing the fork server's preload its start file: multiprocessing passes preloads no
   arguments, so the path travels in the environment while the fork server starts
   (``fork_server_environment``), and is gone from it before the call returns.

Why not a fork server of loaderd's own (issue 37 asked for one or this reason): it would be
~300 lines of fork, descriptor passing and child reaping replacing the pool's most exercised
machinery (every test that starts a daemon runs it), to save the resource tracker process
(~7 MB, 0.4 % of the ``build: once`` memory benchmark) and these private names. The names
(``_forkserver``, ``_forkserver_pid``, ``_forkserver_alive_fd``, ``_forkserver_address``,
``spawn.get_preparation_data``) are the same in CPython 3.11 to 3.14;
``tests/unit/test_multiprocessing_private.py`` fails, naming the missing one, on a Python
where they change.

On 1, ``start_child``: a child of multiprocessing's fork server (or of ``spawn``) first re-runs its parent's
main script or module, as ``__mp_main__``, so that pickled references into ``__main__``
resolve there (the multiprocessing docs' "Safe importing of main module"; CPython issue
137996). The daemon's and ``loaderd check``'s children are sent only a frozen spec
whose entry point lives in an importable module, and a config names datasets by module,
never ``__main__``: the re-run only costs. For ``loaderd serve`` (the console script,
or ``python -m loaderd.server.app.cli``) it imported the CLI and the whole daemon (the gRPC
server, YAML, the scheduler) again in every pool worker: ~8 MB of memory of its own
per worker, and time at every worker's start.

multiprocessing offers no switch for it: the main to re-run travels in the child's
preparation data (``multiprocessing.spawn.get_preparation_data``). ``start_child``
drops it from the data taken for its own starts; every other start, on any thread,
gets multiprocessing's data unchanged. Another library may wrap the same function, over
loaderd's wrapper or under it; each start runs every wrapper once (see
``_preparation_data``).
"""

from __future__ import annotations

import contextlib
import multiprocessing.spawn as mp_spawn
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.process import BaseProcess
from typing import Any

_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")
_install_lock = threading.Lock()
_original: Callable[[str], dict[str, Any]] = mp_spawn.get_preparation_data  # what _preparation_data wraps
# What was there when this module was imported: where a chain of wrappers that loops back to
# ours ends (see _preparation_data).
_beneath: Callable[[str], dict[str, Any]] = mp_spawn.get_preparation_data


class _Starting(threading.local):
    """Whether this thread is inside ``start_child``, and inside ``_preparation_data``."""

    without_main = False
    preparing = False


_starting = _Starting()


def _preparation_data(name: str) -> dict[str, Any]:
    """multiprocessing's preparation data, less the main to re-run inside ``start_child``.

    If another library wrapped this function, ``start_child`` re-installs it on top and
    wraps theirs, which calls this one again: that inner call goes to what was beneath
    at import, so the chain ends and every wrapper still runs once.
    """
    if _starting.preparing:
        return _beneath(name)
    _starting.preparing = True
    try:
        data = _original(name)
    finally:
        _starting.preparing = False
    if _starting.without_main:
        for key in _MAIN_KEYS:
            data.pop(key, None)
    return data


def start_child(process: BaseProcess) -> None:
    """``process.start()``, the child sent no main to re-run.

    The contract: nothing the child is sent (its target, its args) may be pickled by
    reference to ``__main__``; the child could not find it.
    """
    global _original
    with _install_lock:  # multiprocessing looks the function up at each start
        if mp_spawn.get_preparation_data is not _preparation_data:  # first use, or put back since
            _original = mp_spawn.get_preparation_data
            mp_spawn.get_preparation_data = _preparation_data
    outer = _starting.without_main
    _starting.without_main = True
    try:
        process.start()
    finally:
        _starting.without_main = outer


# ------------------------------------------------------------ the fork server's private state


def _fork_server() -> Any:
    """multiprocessing's fork server of this process (its private singleton)."""
    from multiprocessing import forkserver

    return forkserver._forkserver


def fork_server_pid() -> int | None:
    """The pid of this process's fork server; None if it started none (or it was stopped)."""
    pid: int | None = _fork_server()._forkserver_pid
    return pid


def fork_server_alive(pid: int | None) -> bool:
    """Whether the fork server ``pid`` (as ``fork_server_pid`` said when it started) still runs.

    Asked of the write end of its liveness pipe (the fork server holds the only read end):
    POLLERR once the fork server's descriptors are closed, the moment its workers' sentinels
    read EOF. waitid would say so only once the kernel has made it a zombie, a moment later: a
    start in between would let multiprocessing start a new fork server, which built nothing.
    """
    server = _fork_server()
    if pid is None or server._forkserver_pid != pid:
        return False  # never started, or multiprocessing replaced it already
    if server._forkserver_alive_fd is None:
        return False  # stopped
    poller = select.poll()
    poller.register(server._forkserver_alive_fd, select.POLLOUT)
    return not any(events & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, events in poller.poll(0))


def stop_fork_server(timeout: float) -> None:
    """Stop this process's fork server, if it started one, and reap it (so it does not outlive the daemon).

    multiprocessing's own ``_stop`` waits without a timeout; this waits ``timeout`` seconds, then kills.
    """
    server = _fork_server()
    pid = server._forkserver_pid
    if pid is None:
        return
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)  # EOF tells it to exit
        server._forkserver_alive_fd = None
    deadline = time.monotonic() + timeout
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)  # SIGKILLed: returns at once
                break
            time.sleep(0.02)
    except ChildProcessError:  # already reaped
        pass
    server._forkserver_pid = None
    address = server._forkserver_address
    server._forkserver_address = None
    if address and not address.startswith("\0"):
        try:
            os.unlink(address)
        except OSError:
            pass


def drop_fork_server_handle() -> None:
    """In a worker: close its copy of the fork server's liveness pipe.

    The fork server hands every child the write end of the pipe whose EOF tells it the
    daemon is gone. A worker keeping it would keep the fork server alive after a SIGKILLed
    daemon, and the worker, watching its parent (the fork server), would never exit either.
    Workers start no processes, so they drop it.
    """
    server = _fork_server()
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


@contextlib.contextmanager
def fork_server_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in this process's environment while the block starts the fork server (its
    preload reads them: multiprocessing passes preloads no arguments); each is put back as it
    was when the block ends."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
