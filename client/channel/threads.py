"""Joining a call's threads by handle: the client's calls name every thread they must wait for.

A streaming call runs on two threads the client must see end before the interpreter does
(gRPC's threads destroyed mid-call abort the process: "terminate called without an active
exception"): the one that reads its responses (ours) and the one gRPC starts to consume its
request iterator (``consume_request_iterator``, of which gRPC gives no handle). The iterator
records the thread it runs on (``SenderThread.seen``), so the call's owner joins that very
thread, not every thread with a matching name.

The process's exit (``loaderd.fleet.connection``) also joins, by handle, what no owner may be
left to join then: every sender thread ever seen (``senders``: a call whose owner failed or was
dropped before its sender ended) and the background threads registered with ``track``
(an epoch's fleet monitor, which a dropped iterator only tells to stop).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable

# Every sender thread seen, and the background threads registered: joined at the process's exit.
_at_exit: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


class SenderThread:
    """The thread gRPC runs one call's request iterator on, as the iterator saw it."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None

    def seen(self) -> None:
        """Called by the request iterator, on gRPC's thread, before its first request."""
        self.thread = threading.current_thread()
        _at_exit.add(self.thread)


def track(thread: threading.Thread) -> None:
    """Join ``thread`` at the process's exit too (it stops there by itself: EXITING, its stop flag)."""
    _at_exit.add(thread)


def left_at_exit() -> list[threading.Thread]:
    """The threads ``seen`` or ``track``ed that still run."""
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
