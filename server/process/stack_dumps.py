"""Stack dumps on request: ``kill -USR1`` makes a loaderd process write the stack of each of its
Python threads to its stderr (the daemon's log) and go on.

Installed in each process of a daemon that runs our code (the daemon, its fork server, each pool
worker), where SIGUSR1's default action would end it. Not in multiprocessing's resource tracker,
which runs none of ours: signalled with the rest (``systemctl kill -s USR1``, a process group), it
ends; so the docs say to signal the daemon's main process. faulthandler writes from its C signal
handler, without taking the GIL, so a thread that holds the GIL or a lock for ever cannot stop the
dump: what to look at when a daemon stops answering.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

DUMP_SIGNAL = signal.SIGUSR1


def install() -> None:
    """Dump this process's threads on ``DUMP_SIGNAL`` (idempotent); nothing where stderr is not a file."""
    try:
        faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    except (RuntimeError, ValueError, OSError, AttributeError):
        pass  # stderr closed (None) or not a file: no dumps, and the process runs on as before
