"""A thread pool for the gRPC server whose idle threads go away.

A sync ``grpc.server`` runs every call on a thread of the executor it is given
and holds that thread for the call's lifetime (a stream holds it until it
ends). ``concurrent.futures.ThreadPoolExecutor`` never shrinks: a burst of 300
streams leaves 300 idle threads (and their stacks) behind for the life of the
daemon. ``ElasticExecutor`` has the same bound (``max_workers``) but a thread
that finds no work for ``idle_timeout`` seconds exits; the next burst starts
new ones.

Rules (all under one lock):
  * ``submit`` queues the work item, then starts a thread only when the queue
    holds more items than there are idle threads to take them (so a steady
    load reuses the threads it has) and fewer than ``max_workers`` exist;
  * a thread exits only when the queue is empty, checked under the lock, so
    queued work always has a live thread to run it: nothing is lost, and each
    item is popped exactly once, so nothing runs twice;
  * every wait has a timeout and re-checks the shutdown flag.

grpc (``grpc/_server.py``) only calls ``submit`` (while holding its server
lock, so ``submit`` never blocks on work) and ``add_done_callback`` on the
returned future; it never calls ``shutdown``: the owner does, after
``server.stop``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

_names = itertools.count()


class _WorkItem:
    __slots__ = ("future", "fn", "args", "kwargs")

    def __init__(self, future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.future = future
        self.fn = fn
        self.args = args
        self.kwargs = kwargs

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # like ThreadPoolExecutor: the future carries it
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


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
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_WorkItem] = deque()
        self._threads: set[threading.Thread] = set()
        self._idle = 0  # threads waiting in _next_item
        self._started = itertools.count()
        self._shutdown = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)``; never blocks on other work."""
        future: Future[T] = Future()
        item = _WorkItem(future, fn, args, kwargs)
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.append(item)
            if len(self._queue) > self._idle and len(self._threads) < self._max_workers:
                self._start_thread(item)
            else:
                self._cond.notify()
        return future

    def _start_thread(self, item: _WorkItem) -> None:
        """Start one worker (lock held); if it cannot start, withdraw ``item`` and re-raise."""
        thread = threading.Thread(target=self._work, name=f"{self._prefix}_{next(self._started)}", daemon=True)
        self._threads.add(thread)
        try:
            thread.start()
        except BaseException:
            self._threads.discard(thread)
            self._queue.remove(item)
            raise

    def _work(self) -> None:
        """A worker's loop: run items until idle for ``idle_timeout`` or shut down with nothing queued."""
        while (item := self._next_item()) is not None:
            item.run()
            del item  # hold no call state while idle

    def _next_item(self) -> _WorkItem | None:
        """The next queued item, or None (having left the thread set) when this thread should exit."""
        with self._cond:
            deadline = time.monotonic() + self._idle_timeout
            while not self._queue:
                remaining = deadline - time.monotonic()
                if self._shutdown or remaining <= 0:
                    self._threads.discard(threading.current_thread())
                    return None
                self._idle += 1
                try:
                    self._cond.wait(remaining)
                finally:
                    self._idle -= 1
            return self._queue.popleft()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new work; queued work still runs unless ``cancel_futures``; ``wait`` joins the threads."""
        with self._cond:
            self._shutdown = True
            dropped = list(self._queue) if cancel_futures else []
            if cancel_futures:
                self._queue.clear()
            self._cond.notify_all()
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
        with self._cond:
            return len(self._threads)

    def idle(self) -> int:
        """How many of them are waiting for work."""
        with self._cond:
            return self._idle
