"""CopyFence: a pinned slot goes back to the daemon only after the GPU copies queued from it ran.

A training loop does ``x = batch.cuda(non_blocking=True)`` and drops ``batch``.
The copy is only queued: it runs when the stream reaches it, often well after
the host batch is gone (the CPU runs ahead of queued kernels). torch's pinned
allocator therefore keeps a freed block until an event recorded after the copy
has completed. A batch viewing a page-locked shared-memory slot needs the same,
or a worker refills the slot while the DMA still reads it and the GPU gets
another batch's bytes.

The rule, as for torch's pinned memory: copies queued on the stream that is
current when the batch's last reference dies (and on the device's default
stream) are waited for. A copy queued on another stream is the caller's to
order: keep the batch until that stream has run it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("loaderd.copy_fence")

_IDLE_POLL_S = 0.25  # how often an idle fence thread re-checks its stop signal
_MIN_WAIT_S = 0.0002  # polling backoff while an event is pending: 0.2 ms doubling to 2 ms
_MAX_WAIT_S = 0.002
_CLOSE_WAIT_S = 2.0  # at close, how long pending copies may still delay their releases


class Event(Protocol):
    """What the fence needs of a ``torch.cuda.Event``."""

    def query(self) -> bool: ...


def record_stream_events() -> list[Any]:
    """Events recorded now on the current stream and, if another, the default stream (current device)."""
    import torch

    current = torch.cuda.current_stream()
    default = torch.cuda.default_stream()
    events = []
    for stream in (current,) if current == default else (current, default):
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    return events


class CopyFence:
    """Runs each deferred callback once the GPU work queued before its deferral has run.

    ``defer`` is called from a finalizer (any thread); callbacks run on the fence's
    own thread, in order, or inline when the GPU has nothing queued. ``close`` waits
    a bounded time for pending copies, then runs what is left; it is idempotent.
    ``record`` marks "now" on the GPU (``record_stream_events``; tests pass fakes).
    """

    def __init__(self, record: Callable[[], list[Event]] = record_stream_events) -> None:
        self._record = record
        self._pending: collections.deque[tuple[list[Event], Callable[[], None]]] = collections.deque()
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def defer(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the copies queued so far on the current (and default) stream ran."""
        if self._stop.is_set():
            callback()
            return
        try:
            events = self._record()
            if not self._pending and all(e.query() for e in events):
                callback()  # nothing queued: no thread hop
                return
        except Exception as exc:  # noqa: BLE001 - CUDA torn down (exit) or broken: waiting is impossible
            log.debug("cannot fence a pinned slot's release (%s); releasing now", exc)
            callback()
            return
        with self._wake:
            self._pending.append((events, callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="loaderd-copy-fence", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                if not self._pending:
                    self._wake.wait(_IDLE_POLL_S)
                    continue
                events, callback = self._pending[0]
            wait = _MIN_WAIT_S
            while not self._stop.is_set() and not _completed(events):
                time.sleep(wait)
                wait = min(wait * 2, _MAX_WAIT_S)
            if self._stop.is_set():
                return
            with self._wake:
                self._pending.popleft()
            _run_callback(callback)

    def close(self) -> None:
        """Stop the thread; pending callbacks run once their copies ran or after ``_CLOSE_WAIT_S``."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._wake:
            self._wake.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_CLOSE_WAIT_S)
        deadline = time.monotonic() + _CLOSE_WAIT_S
        while True:
            with self._wake:
                if not self._pending:
                    return
                events, callback = self._pending.popleft()
            while time.monotonic() < deadline and not _completed(events):
                time.sleep(_MAX_WAIT_S)
            _run_callback(callback)


def _completed(events: list[Event]) -> bool:
    try:
        return all(e.query() for e in events)
    except Exception:  # noqa: BLE001 - a broken context: nothing will complete, stop holding the slot
        return True


def _run_callback(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        log.exception("releasing a pinned slot failed")
