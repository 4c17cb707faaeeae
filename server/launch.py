"""Starting a fork-server child without it re-running this process's ``__main__``.

A child of multiprocessing's fork server (or of ``spawn``) first re-runs its parent's
main script, as the module ``__mp_main__``, so that pickled references into
``__main__`` resolve there (CPython issue 137996). The daemon's and ``loaderd check``'s
children are sent only a frozen spec whose entry point lives in an importable module,
and a config names datasets by module, never ``__main__``; the re-run only costs. For
``loaderd serve`` (the console script, or ``python -m loaderd.server.cli``) it imported
the CLI and the whole daemon (the gRPC server, YAML, the scheduler) again in every pool
worker: ~8 MB of memory of its own per worker, and time at every worker's start.
"""

from __future__ import annotations

import sys
import threading
from multiprocessing.process import BaseProcess

# Starts may come from several threads (the pool's start, a respawn): one hides and restores at a time.
_lock = threading.Lock()
_ABSENT = object()


def start_child(process: BaseProcess) -> None:
    """``process.start()``, with ``__main__``'s file and spec hidden while multiprocessing reads them.

    With neither (``spawn.get_preparation_data`` reads both), multiprocessing sends the
    child no main to re-run. They are put back before this returns, whatever ``start`` raised.
    Other threads see them hidden meanwhile (a start takes milliseconds); nothing in the
    daemon reads them.
    """
    main = sys.modules["__main__"]
    with _lock:
        spec = main.__spec__  # a module's __spec__ always exists (None for a script): read unguarded
        saved_file = main.__dict__.pop("__file__", _ABSENT)
        main.__spec__ = None
        try:
            process.start()
        finally:
            main.__spec__ = spec
            if saved_file is not _ABSENT:
                main.__file__ = saved_file
