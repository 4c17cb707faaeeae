"""Joining a call's threads by handle: the client's calls name every thread they must wait for.

A streaming call runs on two threads the client must see end before the interpreter does
(gRPC's threads destroyed mid-call abort the process: "terminate called without an active
exception"): the one that reads its responses (ours) and the one gRPC starts to consume its
request iterator (``consume_request_iterator``, of which gRPC gives no handle). The iterator
records the thread it runs on (``SenderThread.seen``), so the call's owner joins that very
thread, not every thread with a matching name.

Every such thread is also registered here (``track``; ``seen`` does it for senders): a call's
receiver, a session's watcher, an epoch's fleet monitor. Their owners join them when they close
(``RemoteDataLoader.close``); the process's exit (``loaderd.fleet.connection``) joins, by handle,
whatever still runs then, whether or not its owner is still there to do it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable

# Every thread a call, session or epoch runs: what still runs at the process's exit is joined then.
_at_exit: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


class SenderThread:
    """The thread gRPC runs one call's request iterator on, as the iterator saw it."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None

    def seen(self) -> None:
        """Called by the request iterator, on gRPC's thread, before its first request."""
        self.thread = threading.current_thread()
        track(self.thread)


def track(thread: threading.Thread) -> None:
    """Join ``thread`` at the process's exit (what it is in ends there: a closed channel, EXITING)."""
    _at_exit.add(thread)


def still_running() -> list[threading.Thread]:
    """The threads ``track``ed (senders ``seen`` included) that still run."""
    return [thread for thread in list(_at_exit) if thread.is_alive()]


def join_all(threads: Iterable[threading.Thread | None], timeout: float) -> bool:
    """Join each thread (None: never started; the calling thread itself is skipped), for up to
    ``timeout`` s in all. True if every one has ended."""
    deadline = time.monotonic() + timeout
    current = threading.current_thread()
    ended = True
    for thread in threads:
        if thread is None or thread is current:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        ended &= not thread.is_alive()
    return ended
