"""ItemThreads: a worker's threads that fetch and transform batches' items side by side (a dataset's ``threads:``).

The rules:
- A worker makes one per dataset after its fork; the threads start at the first batch that
  needs them (the fork server never runs one: no thread may cross a fork).
- ``start(fn, items)`` queues one call (an ``ItemsJob``) and returns at once; its
  ``result()`` returns ``fn``'s results in ``items``' order. ``count`` helper threads make the
  items; the worker's own thread waits for them, and collates a batch while they make the
  next one's (below). ``map(fn, items)`` is ``start(fn, items).result()``. With ``count`` 1 there is no
  helper: the caller makes the items, in order, as torch's worker does.
- Items are taken in order from one counter per call, each by whichever thread is free (items
  of different costs balance). The helpers take the calls in the order they were started: once
  every item of one call is taken (``ItemsJob.wait_taken`` returns then), a helper that turns
  free starts on the next call's. So a batch started behind the one being finished keeps them
  busy through that batch's last items, its collation and the next task's arrival
  (server/worker/batches.py starts the next batch's items that way).
- Once an item of a call has failed no thread starts an item of that call past it; those already
  started run to their end. Then ``result()`` raises the exception of the *first* item that
  failed, by position: the item a one-thread worker would have failed on, with no thread still
  running user code for that call.
- ``chunks(fn, items)`` calls ``fn`` once per thread with a contiguous share of ``items``
  (a dataset's ``__getitems__``) and joins the lists it returns (one item per index, or a
  TypeError); with one thread it returns ``fn(items)`` as it is.
- A thread that cannot start (a limit on the process's threads) leaves the items to those
  that did; with none, the thread that asks for the result makes them all.
- ``result()`` and ``wait_taken()`` have no timeout of their own: every wait there is for user code, which the
  dataset's ``task_timeout`` bounds by replacing the whole worker, as with one thread. An
  idle helper re-checks its stop signal every ``_IDLE_CHECK_S``.
- ``get_worker_info()`` reads a module global, so the threads see the one the worker set
  last. A batch's seeds are set once, before its items start: the threads draw from the same
  generators in whatever order they run, so random augmentation is not reproducible run to
  run with more than one thread (what is deterministic stays so).
- ``resize(count)`` (``threads: auto``, server/worker/thread_sizer.py) changes the count between batches: helpers
  for a larger one start with the next call that needs them; those beyond a smaller one leave between calls,
  once the helpers left serve the calls queued (with none left, the leaving ones finish those calls first, so no
  waiter is left with items nobody takes).
- ``close()`` stops the helpers once their current item ends (items of calls nobody waits for
  any more are not started: one still waited on raises rather than hangs) and joins them, for a
  bounded time: an orphaned worker's daemon is gone, and with it ``task_timeout``. The worker
  calls it at its end.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

# How often an idle helper thread re-checks that it should stop.
_IDLE_CHECK_S = 1.0


class ItemsJob(Generic[R]):
    """One call's items on a worker's threads (``ItemThreads.start``)."""

    def __init__(self, fn: Callable[[Any], R], items: Sequence[Any], helped: bool) -> None:
        """``helped``: helper threads make the items (else the thread that asks for the result makes them all)."""
        self._fn = fn
        self._items = items
        self._n = len(items)
        self.helped = helped
        self._results: list[Any] = [None] * self._n
        self._errors: dict[int, BaseException] = {}
        self._first_failed = self._n  # the lowest position that failed (n: none); no item past it starts
        self._cancelled = False
        # itertools.count's __next__ is one C call under the GIL: each index goes to exactly one thread.
        self._take = itertools.count().__next__
        self._lock = threading.Lock()
        self._left = self._n  # items not finished (run or skipped after a failure)
        self._taken = threading.Event()  # every item taken: the threads turn free as their items end
        self._done = threading.Event()
        if not self._n:
            self._taken.set()
            self._done.set()

    def work_one(self) -> bool:
        """Run the next item nobody took yet, in the calling thread; False once every item is taken."""
        i = self._take()
        if i >= self._n:
            return False
        self._run(i)
        return True

    def _run(self, i: int) -> None:
        """Make item ``i`` (taken by this thread), unless the call failed before it or was cancelled."""
        if i == self._n - 1:
            self._taken.set()
        # Checked after taking too: no item past a failed one starts (one before it still runs, as one thread would
        # have run it first).
        if i < self._first_failed and not self._cancelled:
            try:
                self._results[i] = self._fn(self._items[i])
            except BaseException as exc:  # noqa: BLE001 - the user's code may raise anything: re-raised by result(), in order
                with self._lock:
                    self._errors[i] = exc
                    self._first_failed = min(self._first_failed, i)
        with self._lock:
            self._left -= 1
            if not self._left:
                self._done.set()

    def cancel(self) -> None:
        """Start none of the items not started yet (those running end as they do); nobody will ask for the result."""
        self._cancelled = True

    def abandon(self, reason: BaseException) -> None:
        """No thread will make the items not taken yet: skip them here, so that ``result()`` returns once the running
        ones end, raising ``reason`` (or an item's own earlier failure)."""
        self._cancelled = True
        i = self._take()
        if i >= self._n:
            return  # every item was taken: the threads that took them finish them
        with self._lock:  # before the last item is counted, so result() sees it
            self._errors.setdefault(self._n, reason)  # past every item: an item's own failure comes first
        self._run(i)
        while self.work_one():
            pass

    def wait_taken(self) -> None:
        """Return once every item is taken, when the helpers are about to turn free (without helpers, once this
        thread has made them all)."""
        if self.helped:
            self._taken.wait()  # for the helpers to reach the last item: user code, bounded by task_timeout
        else:
            while self.work_one():
                pass

    def result(self) -> list[R]:
        """The results in order, once every item ended."""
        self.wait_taken()
        self._done.wait()  # for items other threads are running: user code, bounded by task_timeout
        if self._errors:
            first = self._errors[min(self._errors)]
            self._errors.clear()  # the traceback holds this job's frames: no cycle keeps the items alive
            raise first
        return self._results


class ItemThreads:
    """``count`` helper threads (none for 1: the caller makes the items) for one dataset's items in one worker."""

    def __init__(self, count: int, name: str = "") -> None:
        """``name`` goes into the threads' names (the dataset's)."""
        if count < 1:
            raise ValueError(f"threads must be at least 1, got {count}")
        self.count = count
        self._name = f"loaderd-items-{name}" if name else "loaderd-items"
        self._cond = threading.Condition()  # guards _jobs
        self._jobs: deque[ItemsJob[Any]] = deque()  # started, with items not all taken yet; oldest first
        # The running helpers' stop signal: each generation of helpers has its own, so that one still inside user
        # code when ``close`` gave up on it never serves the next generation's calls.
        self._stop = threading.Event()
        self._helpers: list[threading.Thread] = []  # those serving calls now
        self._retire: dict[threading.Thread, threading.Event] = {}  # each helper's own signal to leave (``resize``)
        self._leaving: list[threading.Thread] = []  # helpers told to leave, joined by ``close``
        self._started_for = 0  # the count helpers were last started for (``_start_helpers``)
        self._names = itertools.count()

    def start(self, fn: Callable[[T], R], items: Iterable[T]) -> ItemsJob[R]:
        """Queue ``fn`` over ``items`` for the helper threads, behind the calls started before; returns at once."""
        items = items if isinstance(items, Sequence) else list(items)
        if self.count > 1 and len(items) > 1:
            self._start_helpers()
        helped = bool(self._helpers) and len(items) > 0
        job: ItemsJob[R] = ItemsJob(fn, items, helped)
        if helped:
            with self._cond:
                self._jobs.append(job)
                self._cond.notify_all()
        return job

    def resize(self, count: int) -> None:
        """Run ``count`` threads from now on (``threads: auto``, server/worker/thread_sizer.py). Helpers beyond it leave
        between calls, once no call they were serving depends on them: with none left serving, the calls already
        queued are theirs to finish. Helpers for a larger count start with the next call that needs them."""
        if count < 1:
            raise ValueError(f"threads must be at least 1, got {count}")
        self.count = count
        self._started_for = 0
        keep = count if count > 1 else 0  # one thread: the caller makes the items, no helper
        with self._cond:
            self._leaving = [helper for helper in self._leaving if helper.is_alive()]
            for helper in self._helpers[keep:]:
                self._retire.pop(helper).set()
                self._leaving.append(helper)
            del self._helpers[keep:]
            self._cond.notify_all()

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``[fn(item) for item in items]``, across the threads (the module docstring's rules)."""
        if self.count == 1:
            return [fn(item) for item in items]
        return self.start(fn, items).result()

    def chunks(self, fn: Callable[[list[T]], Any], items: Sequence[T]) -> Any:
        """``fn`` called once per thread on a contiguous share of ``items``; the lists it returns joined in order.

        With one thread (or one item), ``fn(items)`` whatever it returns, as torch passes a ``__getitems__``'s
        result to collation untouched. With more, each share's result must be a list of one item per index
        (torch's contract for ``__getitems__``): anything else is a TypeError saying so, never a silent join."""
        parts = min(self.count, len(items))
        if parts < 2:
            return fn(list(items))
        size, extra = divmod(len(items), parts)
        bounds = list(itertools.accumulate([0] + [size + (k < extra) for k in range(parts)]))
        shares = [list(items[bounds[k] : bounds[k + 1]]) for k in range(parts)]
        joined: list[Any] = []
        for share, result in zip(shares, self.map(fn, shares)):
            if not isinstance(result, list | tuple) or len(result) != len(share):
                got = f"a {type(result).__name__}" + (f" of {len(result)}" if isinstance(result, list | tuple) else "")
                raise TypeError(
                    f"threads: {self.count} calls __getitems__ once per thread, so it must return a list with one item per index; "
                    f"it returned {got} for {len(share)} indices (set threads: 1 to hand its result to collation as it is)"
                )
            joined.extend(result)
        return joined

    def close(self, timeout_s: float = 5.0) -> list[str]:
        """Stop the helper threads and join them, each for at most ``timeout_s`` (idempotent); a later ``start``
        starts new ones. Returns the names of those still inside an item then: the daemon may be gone (an orphaned
        worker), so nothing bounds user code any more. They are daemon threads, and end with the process."""
        stop, self._stop = self._stop, threading.Event()
        with self._cond:
            stop.set()
            dropped = list(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        for job in dropped:  # whoever still waits on one gets an error, not a hang
            job.abandon(RuntimeError("the item threads were closed before every item was made"))
        with self._cond:
            helpers, self._helpers, self._leaving = self._helpers + self._leaving, [], []
            self._retire.clear()
            self._started_for = 0
        deadline = time.monotonic() + timeout_s
        for helper in helpers:
            helper.join(max(0.0, deadline - time.monotonic()))
        return [helper.name for helper in helpers if helper.is_alive()]

    def _start_helpers(self) -> None:
        """Helpers up to ``count``, once for each count; those that cannot start are left out (the next call tries
        again while none runs)."""
        if self._started_for == self.count:
            return
        with self._cond:
            for _ in range(len(self._helpers), self.count):
                retire = threading.Event()
                helper = threading.Thread(target=self._serve, args=(self._stop, retire), name=f"{self._name}_{next(self._names)}", daemon=True)
                try:
                    helper.start()
                except RuntimeError:  # no thread may start (a pids limit): the ones that did, and result()'s caller, do the items
                    if self._helpers:  # tried again at the next call only while none runs
                        self._started_for = self.count
                    return
                self._helpers.append(helper)
                self._retire[helper] = retire
        self._started_for = self.count

    def _serve(self, stop: threading.Event, retire: threading.Event) -> None:
        """A helper's loop: the oldest started call's items, until ``stop`` (its generation's) is set, or ``retire``
        (its own) between calls where other helpers serve them (``resize``)."""
        while True:
            with self._cond:
                while not self._jobs:
                    if stop.is_set() or retire.is_set():
                        return
                    self._cond.wait(_IDLE_CHECK_S)
                if stop.is_set() or (retire.is_set() and self._helpers):
                    return
                job = self._jobs[0]
            while not stop.is_set() and job.work_one():
                pass
            with self._cond:
                if self._jobs and self._jobs[0] is job:  # every item taken: the next call's turn
                    self._jobs.popleft()
