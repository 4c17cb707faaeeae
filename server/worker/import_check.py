"""The daemon's first check: every callable its config names imports, tried in a child.

``check_imports`` (server/worker/user_code.py) imports the datasets' modules, and with them
torch: ~0.15 GB that the daemon itself never uses (its fork server and workers
run that code). So ``loaderd serve`` makes the check in a forked child and only
hears the verdict; the daemon itself only puts the config's ``python_path`` on
its sys.path (its pool hands it to the fork server in the prebuilt payload).
``loaderd check`` and ``loaderd bench`` import in their own process, which goes
on to run the datasets anyway.

The child (``ImportCheck``) is forked before the daemon starts any thread
(``Daemon.start`` creates it first), answers on a pipe and exits; it is killed
if it takes longer than the timeout, and reaped either way. Meanwhile the daemon
starts its pool, whose fork server imports the same modules: the two imports run
side by side rather than one after the other (a second or more of every start).
A failed check wins over whatever the pool's start then says, since its message
names the module; the pool's start gives up as soon as the check has failed.
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


def _check_in_child(config: LoaderConfig, answer: Connection) -> None:
    """The child: the ConfigError's message, or "" if everything imports."""
    # Not the daemon's handlers (they set its drain and stop flags): Ctrl-C or SIGTERM ends the check.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        check_imports(config)
        problem = ""
    except ConfigError as exc:
        problem = str(exc)
    except BaseException as exc:  # noqa: BLE001 - anything else is a verdict too, not a crash
        problem = f"checking the config's imports failed: {type(exc).__name__}: {exc}"
    answer.send(problem)


class ImportCheck:
    """``check_imports`` in a forked child, running while the caller goes on (the pool starts meanwhile).

    Rules: construct it before the process starts any thread (it forks). The check
    has ``timeout`` seconds from construction. ``problem(wait)`` waits at most
    ``wait`` seconds and returns None while the child is still importing, "" once
    everything imported, else what went wrong (a message for a ConfigError; past
    the deadline, that it took too long). ``close()`` (idempotent) kills the child
    if it still runs and reaps it.
    """

    def __init__(self, config: LoaderConfig, timeout: float) -> None:
        apply_python_path(config.python_path)
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._problem: str | None = None
        self._answered = False
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        self._child = context.Process(target=_check_in_child, args=(config, send), name="loaderd-import-check", daemon=True)
        try:
            self._child.start()
        except BaseException:
            self._receive.close()
            raise
        finally:
            send.close()  # the child holds the only write end: EOF means it died

    def problem(self, wait: float = 0.0) -> str | None:
        """None (still importing), "" (everything imports) or the problem; waits ``wait`` s at most."""
        if self._problem is not None:
            return self._problem
        left = self._deadline - time.monotonic()
        if self._receive.poll(max(0.0, min(wait, left))):
            try:
                self._problem = self._receive.recv()
                self._answered = True
            except EOFError:
                self._child.join(_REAP_S)
                self._problem = f"importing the config's datasets ended the process (exit code {self._child.exitcode})"
        elif time.monotonic() >= self._deadline:
            self._problem = f"importing the config's datasets took longer than {self._timeout:g}s (startup timeout)"
        return self._problem

    def raise_problem(self) -> None:
        """Wait for the verdict (until the deadline at most); ConfigError if the check failed."""
        problem = self.problem(self._deadline - time.monotonic())
        if problem:
            raise ConfigError(problem)

    def close(self) -> None:
        self._receive.close()
        if self._child.pid is None:
            return
        self._child.join(_REAP_S if self._answered else 0.0)  # one that answered exits on its own
        if self._child.is_alive():  # no answer in time, or stuck on its way out
            self._child.kill()
            self._child.join(_REAP_S)
