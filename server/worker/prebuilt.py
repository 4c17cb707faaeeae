"""Datasets built once, in the fork server, before it forks any worker (``build: once``).

A dataset built in each worker costs the pool N copies of its memory. With
``build: once`` the pool (server/pool/fork_server.py) writes the datasets' specs to a
private file (``write_payload``), names it in the environment variable ``ENV``
while it starts its fork server, and the fork server builds them when it imports
``loaderd.server.worker.build_once`` among its preloads (that module exists for this side
effect; nothing else imports it), before it forks the first worker. Every worker it forks, replacements
included, inherits the object: its pages are shared copy-on-write, one copy for
the whole pool, as torch's workers share the dataset their parent built.
``gc.freeze()`` then keeps the workers' garbage collector from writing to those
objects (each write would copy a page).

The pool writes the payload (``Payload``) for every fork server, with or
without such datasets: it also carries the config's ``python_path`` (Python
3.11's fork server drops the ``sys.path`` multiprocessing hands it) and modules,
which the fork server imports once for the whole pool. A module that raises is
skipped there (multiprocessing's own preload would end the fork server, with a
traceback): the daemon's import check reports it by name, and a worker that
needs it raises the same error when it builds its datasets.

Rules:

* Only the fork server builds (``build_from_environment``, called by
  ``build_once``); the daemon process never builds a dataset.
* A failure never escapes: the fork server must live on (it forks every worker).
  A dataset that failed is kept as its message, and each worker that asks for it
  gets ``BuildFailed`` with that message, which it reports as its start failure.
* The payload is the server's own config (pickled by the daemon for its own fork
  server, in a 0600 file the pool removes once the fork server has read it), never
  anything a client sent. A fork server that multiprocessing restarts later finds no
  payload: workers it forks import the config's modules themselves. A pool with
  ``build: once`` datasets starts none there: ``WorkerPool.respawn`` sees the fork
  server it started gone and raises ``PoolLostError``, which stops the daemon (to be
  restarted); a worker that still asked for such a dataset would get ``BuildFailed``.
"""

from __future__ import annotations

import gc
import os
import pickle
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loaderd.server.config.schema import DatasetSpec
from loaderd.server.process import glibc_tunables, stack_dumps
from loaderd.server.process.log_format import configure_logging
from loaderd.server.worker.user_code import apply_python_path, import_config_module, resolve, user_error

ENV = "LOADERD_BUILD_ONCE"

_built: dict[str, Any] = {}
_failed: dict[str, str] = {}
_unread: list[str] = []  # why the payload itself could not be read (then nothing was built)


class BuildFailed(Exception):
    """A ``build: once`` dataset could not be built in the fork server; the message says why."""


@dataclass(frozen=True)
class Payload:
    """What a pool's fork server needs before it forks: the datasets to build once, where to import
    from, the config's modules (imported once for the pool), how to log (level, format), and the
    ``GLIBC_TUNABLES`` what workers start should see (None: unset; server/process/glibc_tunables.py)."""

    build_once: Sequence[DatasetSpec]
    python_path: Sequence[str]
    modules: Sequence[str]
    log: tuple[str, str]
    glibc_tunables: str | None


def write_payload(payload: Payload) -> str:
    """Write ``payload`` to a new private file; its path (for ``ENV``). OSError or PicklingError
    (nothing left behind) if it cannot.

    A file, not the variable's value: a config's kwargs can pass the kernel's limit on one
    environment string (128 KiB), and a variable's initial value stays readable in /proc.
    """
    fd, path = tempfile.mkstemp(prefix="loaderd-build-once-", suffix=".pickle")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(payload, f)
    except BaseException:
        os.unlink(path)
        raise
    return path


def take(spec: DatasetSpec) -> Any:
    """The dataset this process inherited for ``spec`` (a worker's call); BuildFailed if there is none."""
    if spec.name in _built:
        return _built[spec.name]
    if spec.name in _failed:
        raise BuildFailed(_failed[spec.name])
    if _unread:
        raise BuildFailed(_unread[0])
    raise BuildFailed("it was not built in this fork server (multiprocessing restarted the fork server; restart the daemon)")


def build_from_environment() -> None:
    """Build what ``ENV`` names (in the fork server, before it forks); record each failure as its message."""
    stack_dumps.install()  # the fork server is signalled with its daemon too (a process group, a unit)
    path = os.environ.pop(ENV, None)  # popped: the workers' own children must not build again
    if not path:
        return
    try:
        with open(path, "rb") as f:
            payload: Payload = pickle.load(f)
    except Exception as exc:  # noqa: BLE001 - the fork server must survive; workers report it
        _unread.append(f"the fork server could not read the datasets to build ({path}: {type(exc).__name__}: {exc})")
        return
    # This process's glibc read its own setting at start; what the workers start gets the operator's.
    glibc_tunables.restore(payload.glibc_tunables)
    configure_logging(*payload.log)  # a constructor's log lines look like the daemon's
    apply_python_path(payload.python_path)
    for module in payload.modules:
        try:
            import_config_module(module)
        except BaseException:  # noqa: BLE001 - even SystemExit: the daemon's import check and the workers report it
            pass
    for spec in payload.build_once:
        try:
            _built[spec.name] = resolve(spec.factory)(*spec.args, **spec.kwargs)
        except BaseException as exc:  # noqa: BLE001 - even SystemExit: the fork server must survive
            _failed[spec.name] = user_error(exc)
    # Everything built so far lives as long as the fork server and its workers: out of the collector's way.
    gc.freeze()
