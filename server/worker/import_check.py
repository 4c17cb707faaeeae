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
fails is the child told to check; a failed check wins over whatever the pool's start
said, since its message names the module. A pool that started imported everything, and
the child is killed unused: a start that succeeds imports torch and the datasets' modules
once, not twice side by side (docs/pages/performance.md has the figure). The child
answers on a pipe and exits; it ends with the daemon (EOF on the pipe it waits on), is
killed if it takes longer than its time, and is reaped either way.
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
# The least time the check gets once told, whatever is left of the startup timeout: it imports torch first.
CHECK_S = 10.0


def _check_in_child(config: LoaderConfig, go: Connection, answer: Connection, parents: tuple[Connection, ...], wait: float) -> None:
    """The child: once told to ``go``, the ConfigError's message, or "" if everything imports. Nothing if
    the daemon closes ``go`` or ends (or says nothing within ``wait``)."""
    # Not the daemon's handlers (they set its drain and stop flags): Ctrl-C or SIGTERM ends the check.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for end in parents:  # the daemon's ends, inherited: holding its write end, ``go`` would never see EOF
        end.close()
    try:
        if not go.poll(wait) or not go.recv():
            return
    except (EOFError, OSError):  # the daemon went on without a check, or ended
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

    Rules: construct it before the process starts any thread (it forks). ``raise_problem``
    tells the child to check and waits for its verdict until ``timeout`` from construction
    is up, or ``CHECK_S`` at least (a pool may fail just before that deadline, and the check
    then imports torch first); it raises ConfigError with the problem (a message for a
    ConfigError, or that importing ended the child). It says nothing, and the caller's own
    error stands, where it has no verdict: the deadline passed already (the pool's start
    used it all, and says where it was), the child was gone before it was told (killed with
    the process group, say), or it did not answer in time. ``close()`` (idempotent) kills
    the child if it still runs and reaps it.
    """

    def __init__(self, config: LoaderConfig, timeout: float) -> None:
        apply_python_path(config.python_path)
        self._deadline = time.monotonic() + timeout
        self._answered = False
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        go, self._go = context.Pipe(duplex=False)
        parents = (self._receive, self._go)
        self._child = context.Process(
            target=_check_in_child, args=(config, go, send, parents, timeout + CHECK_S), name="loaderd-import-check", daemon=True
        )
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
        """Check now and wait for the verdict (see the class); ConfigError if the check failed."""
        left = self._deadline - time.monotonic()
        if left <= 0 or self._answered or not self._child.is_alive():
            return
        try:
            self._go.send(True)  # the child has waited, importing nothing, until now
        except OSError:  # it died just now: its EOF below says so
            pass
        if not self._receive.poll(max(left, CHECK_S)):
            return
        try:
            problem = self._receive.recv()
            self._answered = True
        except EOFError:
            self._child.join(_REAP_S)
            problem = f"importing the config's datasets ended the process (exit code {self._child.exitcode})"
        if problem:
            raise ConfigError(problem)

    def close(self) -> None:
        """Kill the child if it still runs (one never told would return on the closed pipe, but need not be
        waited for) and reap it. Idempotent."""
        self._receive.close()
        self._go.close()
        if self._child.pid is None:
            return
        self._child.join(_REAP_S if self._answered else 0.0)  # one that answered exits on its own
        if self._child.is_alive():
            self._child.kill()
            self._child.join(_REAP_S)
