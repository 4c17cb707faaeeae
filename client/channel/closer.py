"""Finalizer: what a dropped object leaves open is closed on one owned thread, never where it died.

A ``weakref.finalize`` callback runs wherever its object dies: in a garbage collection on any
thread, in the middle of whatever that thread was doing, with whatever locks it holds. gRPC's
own threads are among them (they allocate while holding a call's state lock). Cancelling a gRPC
call from there takes that call's lock, which a thread waiting for a lock the dying thread holds
may have: both wait forever (the pattern of grpc/grpc#36927; CI saw it twice, the main thread
blocked in a stream's finalizer on ``cancel()`` until the test's timeout).

So loaderd's finalizers close nothing where they run. ``Finalizer(owner, function, *args)``:

- Called (``close()``, ``cancel()``): ``function(*args)`` runs at once on the caller's thread,
  which holds no lock behind the caller's back. At most once, whichever comes first.
- ``owner`` collected without that: the work is posted on a ``queue.SimpleQueue`` (whose ``put``
  is reentrant: safe in a finalizer) and the process's closer thread (``loaderd-closer``) runs it,
  holding nothing else. An error there is logged: nobody is left to raise it to.
- ``detach()``: it never runs.
- ``wait(timeout)``: until it ran (either way) or was detached; True if it did. A loader's next epoch waits so for
  the streams of the one dropped before it, as it did when the drop cancelled them where it happened.

The closer thread starts with the first Finalizer a process makes (starting a thread takes locks,
so never from a finalizer) and runs until the process's exit, where ``stop`` (called by the exit
hook, loaderd.fleet.connection, before it closes the channels) runs what was posted and joins it.
An owner still alive then is not finalized (``atexit=False``): the exit hook closes its connection,
which cancels its call, and ends its session, which gives its slots back.
A forked child gets a closer of its own, started with its own first Finalizer; the work its
inherited finalizers post is the parent's, and every such function checks the process and does
nothing in another (an inherited lock or event may have been held at the fork).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("loaderd.closer")

# How often the idle closer thread re-checks its stop signal.
_POLL_S = 1.0

_Work = tuple[Callable[..., None], tuple[Any, ...], threading.Event]


class _Closer:
    """The process's closer thread and its queue."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Make sure the thread runs (a no-op once it does, and once the process is exiting)."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            return
        with self._lock:
            if self._stop.is_set() or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=_run, args=(self._queue, self._stop), name="loaderd-closer", daemon=True)
            self._thread.start()

    def post(self, function: Callable[..., None], args: tuple[Any, ...], done: threading.Event) -> None:
        """Queue ``function(*args)`` for the thread, which sets ``done`` after it (a finalizer's callback: never blocks)."""
        self._queue.put((function, args, done))

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for what was posted so far to have run; True if it did."""
        done = threading.Event()
        self.post(_nothing, (), done)
        return done.wait(timeout)

    def stop(self, timeout: float) -> bool:
        """Run what was posted, then end the thread, waiting up to ``timeout`` s; True if it ended.
        Idempotent; what is posted afterwards never runs (the process is exiting: its channels close)."""
        with self._lock:
            self._stop.set()
            thread = self._thread
        self._queue.put(None)
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()


def _run(work: queue.SimpleQueue[_Work | None], stop: threading.Event) -> None:
    while True:
        try:
            item = work.get(timeout=_POLL_S)
        except queue.Empty:
            if stop.is_set():
                return
            continue
        if item is None:
            return
        _close(*item)
        del item  # what it closed goes now, not when the next work comes


def _close(function: Callable[..., None], args: tuple[Any, ...], done: threading.Event) -> None:
    try:
        function(*args)
    except Exception:
        log.exception("loaderd: closing what a dropped object left open failed: %r", function)
    finally:
        done.set()


def _nothing() -> None:
    pass


_closer = _Closer()


def _new_closer_in_child() -> None:
    """A forked child: the parent's thread is not here, and its lock may have been held at the fork."""
    global _closer
    _closer = _Closer()


os.register_at_fork(after_in_child=_new_closer_in_child)


class Finalizer:
    """Runs ``function(*args)`` once: at once when called, or on the closer thread once ``owner`` is
    collected (see the module's docstring). Holds no reference to ``owner``."""

    __slots__ = ("_done", "_finalize")

    def __init__(self, owner: object, function: Callable[..., None], *args: Any) -> None:
        _closer.start()
        self._done = threading.Event()
        # post is looked up at collection: a forked child posts to its own closer.
        self._finalize = weakref.finalize(owner, _post, function, args, self._done)
        self._finalize.atexit = False  # the exit hook closes what is still open (the module's docstring)

    def __call__(self) -> None:
        """Run it now, on this thread, unless it ran (or was posted, or detached) already."""
        detached = self._finalize.detach()
        if detached is not None:
            _owner, _post_function, (function, args, done), _kwargs = detached
            try:
                function(*args)
            finally:
                done.set()

    def detach(self) -> None:
        """It never runs."""
        if self._finalize.detach() is not None:
            self._done.set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until it ran (here or on the closer thread) or was detached; True if it did."""
        return self._done.wait(timeout)

    @property
    def alive(self) -> bool:
        """Neither run, posted nor detached yet."""
        return self._finalize.alive


def _post(function: Callable[..., None], args: tuple[Any, ...], done: threading.Event) -> None:
    _closer.post(function, args, done)


def settle(timeout: float) -> bool:
    """Wait up to ``timeout`` s until the work finalizers posted so far has run (for tests: a drop's effects)."""
    return _closer.settle(timeout)


def stop(timeout: float) -> bool:
    """At the process's exit: run what was posted and join the closer thread (``_Closer.stop``)."""
    return _closer.stop(timeout)
