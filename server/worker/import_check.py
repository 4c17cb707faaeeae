"""The daemon's first check: every callable its config names imports, tried in a child.

``check_imports`` (server/worker/user_code.py) imports the datasets' modules, and with them
torch: ~0.15 GB that the daemon itself never uses (its fork server and workers
run that code). So ``loaderd serve`` makes the check in a forked child and only
hears the verdict; the daemon itself only puts the config's ``python_path`` on
its sys.path (its pool hands it to the fork server in the prebuilt payload).
``loaderd check`` and ``loaderd bench`` import in their own process, which goes
on to run the datasets anyway.

The child (``ImportCheck``) is forked before the daemon starts any thread
(``Daemon.start`` creates it first) and waits, importing nothing, while the daemon
starts its pool, whose fork server imports the same modules. Only if the pool's start
fails is the child told to check (a failed check wins over whatever the pool's start
said, since its message names the module); a pool that started imported everything,
and the child is killed unused. A start that succeeds so pays no second import of torch
and the datasets' modules: ~1 CPU-second, and ~0.2 s of the start's wall time even on
an idle 2-core host (the two imports competed), more on a busy or 1-core one. The child
answers on a pipe and exits; it is killed if it takes longer than the timeout, and
reaped either way.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from multiprocessing.connection import Connection

from loaderd.server.config.schema import ConfigError, LoaderConfig
from loaderd.server.worker.user_code import apply_python_path, check_imports

# After a kill, how long to wait for the child to be gone.
_REAP_S = 5.0


def _check_in_child(config: LoaderConfig, go: Connection, answer: Connection, timeout: float) -> None:
    """The child: once told to ``go``, the ConfigError's message, or "" if everything imports. Nothing if
    the daemon closes ``go`` (or says nothing within ``timeout``)."""
    # Not the daemon's handlers (they set its drain and stop flags): Ctrl-C or SIGTERM ends the check.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        # Past the daemon's deadline (``timeout`` from just before the fork) its pool has given up already.
        if not go.poll(timeout + _REAP_S) or not go.recv():
            return
    except (EOFError, OSError):  # the daemon went on without a check
        return
    try:
        check_imports(config)
        problem = ""
    except ConfigError as exc:
        problem = str(exc)
    except BaseException as exc:  # noqa: BLE001 - anything else is a verdict too, not a crash
        problem = f"checking the config's imports failed: {type(exc).__name__}: {exc}"
    answer.send(problem)


class ImportCheck:
    """``check_imports`` in a child forked at construction, made only when ``raise_problem`` asks (the pool's
    start failed).

    Rules: construct it before the process starts any thread (it forks). The check has
    ``timeout`` seconds from construction: ``raise_problem`` tells the child to check and
    waits for its verdict until then, raising ConfigError with the problem (a message for a
    ConfigError, or that importing ended the child, or took past the deadline); past the
    deadline already (the pool's start used it all) it checks nothing and returns, and the
    caller's own error stands. ``close()`` (idempotent) kills the child if it still runs and
    reaps it.
    """

    def __init__(self, config: LoaderConfig, timeout: float) -> None:
        apply_python_path(config.python_path)
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._answered = False
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        go, self._go = context.Pipe(duplex=False)
        self._child = context.Process(target=_check_in_child, args=(config, go, send, timeout), name="loaderd-import-check", daemon=True)
        try:
            self._child.start()
        except BaseException:
            self._receive.close()
            self._go.close()
            raise
        finally:
            send.close()  # the child holds the only write end: EOF means it died
            go.close()

    def raise_problem(self) -> None:
        """Check now, waiting for the verdict until the deadline at most; ConfigError if the check failed."""
        left = self._deadline - time.monotonic()
        if left <= 0 or self._answered:
            return
        try:
            self._go.send(True)  # the child has waited, importing nothing, until now
        except OSError:  # it is gone: its EOF below says so
            pass
        if not self._receive.poll(left):
            raise ConfigError(f"importing the config's datasets took longer than {self._timeout:g}s (startup timeout)")
        try:
            problem = self._receive.recv()
            self._answered = True
        except EOFError:
            self._child.join(_REAP_S)
            problem = f"importing the config's datasets ended the process (exit code {self._child.exitcode})"
        if problem:
            raise ConfigError(problem)

    def close(self) -> None:
        self._receive.close()
        self._go.close()  # an untold child returns at once
        if self._child.pid is None:
            return
        self._child.join(_REAP_S if self._answered else 0.0)  # one that answered exits on its own
        if self._child.is_alive():  # no answer in time, or stuck on its way out
            self._child.kill()
            self._child.join(_REAP_S)
