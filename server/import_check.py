"""The daemon's first check: every callable its config names imports, tried in a child.

``check_imports`` (server/config.py) imports the datasets' modules, and with them
torch: ~0.15 GB that the daemon itself never uses (its fork server and workers
run that code). So ``loaderd serve`` makes the check in a forked child and only
hears the verdict; the daemon gets the config's ``python_path`` (which its fork
server inherits) and nothing else. ``loaderd check`` and ``loaderd bench`` import
in their own process, which goes on to run the datasets anyway.

The child is forked before the daemon starts any thread (``Daemon.start`` calls
this first), answers on a pipe and exits; it is killed if it takes longer than
the timeout, and reaped either way.
"""

from __future__ import annotations

import multiprocessing
import signal
from multiprocessing.connection import Connection

from loaderd.server.config import ConfigError, LoaderConfig, apply_python_path, check_imports

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


def check_imports_apart(config: LoaderConfig, timeout: float) -> None:
    """``check_imports`` without importing anything here: raises its ConfigError (or one for a child
    that took longer than ``timeout`` seconds or died without an answer)."""
    apply_python_path(config.python_path)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_check_in_child, args=(config, send), name="loaderd-import-check", daemon=True)
    try:
        child.start()
        send.close()  # the child holds the only write end: EOF means it died
        if not receive.poll(timeout):
            raise ConfigError(f"importing the config's datasets took longer than {timeout:g}s (startup timeout)")
        try:
            problem = receive.recv()
        except EOFError:
            child.join(_REAP_S)
            raise ConfigError(f"importing the config's datasets ended the process (exit code {child.exitcode})") from None
        child.join(_REAP_S)  # it answered: let it exit on its own (its modules' exit handlers run)
    finally:
        send.close()
        receive.close()
        if child.is_alive():  # no answer in time, or stuck on its way out
            child.kill()
        if child.pid is not None:
            child.join(_REAP_S)
    if problem:
        raise ConfigError(problem)
