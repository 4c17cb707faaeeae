"""Starting a multiprocessing child without it re-running this process's ``__main__``.

A child of multiprocessing's fork server (or of ``spawn``) first re-runs its parent's
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

import multiprocessing.spawn as mp_spawn
import threading
from collections.abc import Callable
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
