"""ItemThreads: a worker's threads that fetch and transform one batch's items side by side (a dataset's ``threads:``).

The rules:
- A worker makes one per dataset after its fork; the threads start at the first batch that
  needs them (the fork server never runs one: no thread may cross a fork).
- ``map(fn, items)`` returns ``fn``'s results in ``items``' order. The calling thread works
  too, so ``threads: 2`` is the worker's own thread and one more.
- Items are taken in order from one counter, each by whichever thread is free (items of
  different costs balance). Once a call has failed no thread starts another item; those
  already started run to their end. Then the exception of the *first* item that failed, by
  position, is raised: the item a one-thread worker would have failed on, with no thread
  still running user code for the batch.
- ``chunks(fn, items)`` calls ``fn`` once per thread with a contiguous share of ``items``
  (a dataset's ``__getitems__``) and joins the lists it returns (one item per index, or a
  TypeError); with one thread it returns ``fn(items)`` as it is.
- A thread that cannot start (a limit on the process's threads) leaves the batch to those
  that did.
- No wait here has a timeout of its own: every wait is for user code, which the dataset's
  ``task_timeout`` bounds by replacing the whole worker, as with one thread.
- ``get_worker_info()`` reads a module global, so the threads see the batch's. The batch's
  seeds are set once, before the threads start on it: they draw from the same generators in
  whatever order they run, so random augmentation is not reproducible run to run with more
  than one thread (what is deterministic stays so).
- ``close()`` joins the threads; the worker calls it at its end.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class ItemThreads:
    """``count`` threads (the caller's among them) for one dataset's items in one worker."""

    def __init__(self, count: int, name: str = "") -> None:
        if count < 1:
            raise ValueError(f"threads must be at least 1, got {count}")
        self.count = count
        self._name = f"loaderd-items-{name}" if name else "loaderd-items"
        self._helpers: ThreadPoolExecutor | None = None

    def _pool(self) -> ThreadPoolExecutor:
        if self._helpers is None:
            self._helpers = ThreadPoolExecutor(self.count - 1, thread_name_prefix=self._name)
        return self._helpers

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``[fn(item) for item in items]``, across the threads (the module docstring's rules)."""
        if self.count == 1:
            return [fn(item) for item in items]
        items = items if isinstance(items, Sequence) else list(items)
        n = len(items)
        if n < 2:
            return [fn(item) for item in items]
        results: list[Any] = [None] * n
        errors: dict[int, BaseException] = {}
        # itertools.count's __next__ is one C call under the GIL: each index goes to exactly one thread.
        take = itertools.count().__next__

        def drain() -> None:
            while True:
                i = take()
                if i >= n or errors:  # checked after taking too: no item starts once one has failed
                    return
                try:
                    results[i] = fn(items[i])
                except BaseException as exc:  # noqa: BLE001 - the user's code may raise anything: re-raised below, in order
                    errors[i] = exc

        helpers: list[Future[None]] = []
        try:
            for _ in range(min(self.count, n) - 1):
                helpers.append(self._pool().submit(drain))
        except RuntimeError:  # no thread may start (a pids limit): the ones that did, and this one, do the batch
            pass
        try:
            drain()
        finally:
            for helper in helpers:
                helper.result()  # drain() itself never raises
        if errors:
            first = errors[min(errors)]
            errors.clear()  # the traceback holds drain's frame, which holds ``errors``: no cycle to keep the items alive
            raise first
        return results

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

    def close(self) -> None:
        """Join the threads (idempotent); a later ``map`` starts them again."""
        helpers, self._helpers = self._helpers, None
        if helpers is not None:
            helpers.shutdown(wait=True)
