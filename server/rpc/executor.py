"""A thread pool for the gRPC server whose idle threads go away.

A sync ``grpc.server`` runs every call on a thread of the executor it is given
and holds that thread for the call's lifetime (a stream holds it until it
ends). ``concurrent.futures.ThreadPoolExecutor`` never shrinks: a burst of 300
streams leaves 300 idle threads (and their stacks) behind for the life of the
daemon. ``ElasticExecutor`` has the same bound (``max_workers``) but a thread
that finds no work for ``idle_timeout`` seconds exits; the next burst starts
new ones.

Rules (all under one lock):
  * ``submit`` hands the work item to the thread that went idle LAST, if any;
    else starts a thread, if fewer than ``max_workers`` exist; else queues it.
    Handing work to the most recently idle thread (not the longest idle, which
    is what a shared condition's ``notify`` does) lets a light steady load run
    on a few threads while the rest time out: a Status call every half second
    otherwise kept 60 threads alive for ever, each woken every 30 s;
  * a thread takes queued work before going idle, and exits only when it timed
    out with nothing handed to it, so queued work always has a live thread:
    nothing is lost, and each item is taken exactly once, so nothing runs twice;
  * every wait has a timeout and re-checks the shutdown flag.

grpc (``grpc/_server.py``) only calls ``submit`` (while holding its server
lock, so ``submit`` never blocks on work) and ``add_done_callback`` on the
returned future; it never calls ``shutdown``: the owner does, after
``server.stop``.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

_names = itertools.count()


class _WorkItem:
    __slots__ = ("args", "fn", "future", "kwargs")

    def __init__(self, future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.future = future
        self.fn = fn
        self.args = args
        self.kwargs = kwargs

    def call(self) -> tuple[bool, Any] | None:
        """Run the function: (True, result) or (False, exception); None if the future was cancelled."""
        if not self.future.set_running_or_notify_cancel():
            return None
        try:
            return True, self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # noqa: BLE001 - like ThreadPoolExecutor: the future carries it
            return False, exc

    def complete(self, outcome: tuple[bool, Any] | None) -> None:
        if outcome is None:
            return
        ok, value = outcome
        if ok:
            self.future.set_result(value)
        else:
            self.future.set_exception(value)


class _Waiter:
    """An idle thread's mailbox: ``submit`` puts an item in it and sets the event."""

    __slots__ = ("event", "item")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.item: _WorkItem | None = None


class ElasticExecutor(Executor):
    """At most ``max_workers`` daemon threads; one idle for ``idle_timeout`` seconds exits."""

    def __init__(self, max_workers: int, idle_timeout: float = 30.0, thread_name_prefix: str = "") -> None:
        if max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if idle_timeout <= 0:
            raise ValueError("idle_timeout must be greater than 0")
        self._max_workers = max_workers
        self._idle_timeout = idle_timeout
        self._prefix = thread_name_prefix or f"ElasticExecutor-{next(_names)}"
        self._lock = threading.Lock()
        self._queue: deque[_WorkItem] = deque()  # only when every thread is busy and none may start
        self._threads: set[threading.Thread] = set()
        self._idle_waiters: list[_Waiter] = []  # a stack: the last to go idle is handed work first
        self._busy = 0  # threads running an item (the rest are idle or between items)
        self._started = itertools.count()
        self._shutdown = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)``; never blocks on other work."""
        future: Future[T] = Future()
        item = _WorkItem(future, fn, args, kwargs)
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._idle_waiters:
                waiter = self._idle_waiters.pop()  # the most recently idle
                waiter.item = item
                waiter.event.set()
                self._busy += 1
            elif len(self._threads) > self._busy or len(self._threads) >= self._max_workers:
                # A thread just finished and is on its way to take queued work (or none may start).
                self._queue.append(item)
            else:
                self._start_thread(item)
                self._busy += 1
        return future

    def _start_thread(self, item: _WorkItem) -> None:
        """Start one worker on ``item`` (lock held)."""
        thread = threading.Thread(target=self._work, args=(item,), name=f"{self._prefix}_{next(self._started)}", daemon=True)
        self._threads.add(thread)
        try:
            thread.start()
        except BaseException:
            self._threads.discard(thread)
            raise

    def _work(self, item: _WorkItem | None) -> None:
        """A worker's loop: run items until idle for ``idle_timeout`` or shut down with nothing queued."""
        while item is not None:
            outcome = item.call()
            with self._lock:
                # Not busy before the future completes: whoever waits on it and submits
                # again at once finds this thread on its way to take the work.
                self._busy -= 1
            item.complete(outcome)
            del item, outcome  # hold no call state while idle
            item = self._next_item()

    def _next_item(self) -> _WorkItem | None:
        """The next item (queued, or handed to this thread while idle), or None (having left the thread set)."""
        with self._lock:
            if self._queue:
                self._busy += 1
                return self._queue.popleft()
            if self._shutdown:
                self._threads.discard(threading.current_thread())
                return None
            waiter = _Waiter()
            self._idle_waiters.append(waiter)
        waiter.event.wait(self._idle_timeout)
        with self._lock:
            if waiter.item is not None:
                return waiter.item
            if waiter in self._idle_waiters:
                self._idle_waiters.remove(waiter)
            if self._queue and not self._shutdown:  # queued while this thread was leaving the waiters
                self._busy += 1
                return self._queue.popleft()
            self._threads.discard(threading.current_thread())
            return None

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new work; queued work still runs unless ``cancel_futures``; ``wait`` joins the threads."""
        with self._lock:
            self._shutdown = True
            dropped = list(self._queue) if cancel_futures else []
            if cancel_futures:
                self._queue.clear()
            for waiter in self._idle_waiters:
                waiter.event.set()  # nothing handed: it exits
            self._idle_waiters.clear()
            threads = list(self._threads)
        for item in dropped:  # outside the lock: cancel() runs the futures' callbacks
            item.future.cancel()
        if wait:
            me = threading.current_thread()
            for thread in threads:
                if thread is not me:
                    thread.join()

    def threads(self) -> int:
        """How many worker threads exist now."""
        with self._lock:
            return len(self._threads)

    def idle(self) -> int:
        """How many of them are waiting for work."""
        with self._lock:
            return len(self._idle_waiters)
