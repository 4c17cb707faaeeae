"""Admission: how many calls clients hold open, and refusing what is over the limits.

Every ``Session`` and ``StreamBatches`` call holds one gRPC handler thread for
its whole life. The daemon admits at most ``limits.max_sessions`` sessions and
``limits.max_streams`` streams in all, and ``limits.max_streams_per_client``
streams per client (its session, or its connection when it has none); the
thread pool is sized above their sum, so short calls (health, Status,
ListDatasets) always find a thread however many long ones are open.

Calls are counted from their start, before their first message, so silent
calls cannot take the threads either. A refusal is a ``LimitExceededError``
naming the limit (RESOURCE_EXHAUSTED on the wire). Each admission returns a ``Ticket`` whose ``release`` is idempotent,
so the call's end and its context callback may both release it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from loaderd.errors import LimitExceededError
from loaderd.server.config.schema import Limits

# Threads beyond the long-lived calls' limits, for short calls and refusals.
SHORT_CALL_THREADS = 64


def handler_threads(limits: Limits) -> int:
    """How many gRPC handler threads the daemon needs for ``limits``."""
    return limits.max_sessions + limits.max_streams + SHORT_CALL_THREADS


class AdmissionRefused(LimitExceededError):
    """Over one of the daemon's admission limits (calls open, in all or per client): the client hears
    ``Reason.ADMISSION_LIMIT``, and another daemon may take the call."""


class Ticket:
    """One admitted call; ``release`` it when the call ends (idempotent, thread-safe)."""

    def __init__(self, on_release: Callable[[], None]) -> None:
        self._on_release: Callable[[], None] | None = on_release
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release()


class Admission:
    """Counts open sessions and streams (in all and per client) against ``limits``."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._lock = threading.Lock()
        self._sessions = 0
        self._streams = 0
        self._per_client: dict[str, int] = {}

    def admit_session(self) -> Ticket:
        with self._lock:
            if self._sessions >= self._limits.max_sessions:
                raise AdmissionRefused(
                    f"the daemon has {self._sessions} client sessions open, its limit (limits.max_sessions)"
                )
            self._sessions += 1
        return Ticket(self._leave_session)

    def _leave_session(self) -> None:
        with self._lock:
            self._sessions -= 1

    def admit_stream(self) -> Ticket:
        """A new ``StreamBatches`` call, counted from its start (before its first message)."""
        with self._lock:
            if self._streams >= self._limits.max_streams:
                raise AdmissionRefused(f"the daemon has {self._streams} streams open, its limit (limits.max_streams)")
            self._streams += 1
        return Ticket(self._leave_stream)

    def _leave_stream(self) -> None:
        with self._lock:
            self._streams -= 1

    def admit_client_stream(self, client: str) -> Ticket:
        """The stream (already admitted) turned out to be ``client``'s (a session or connection key)."""
        with self._lock:
            mine = self._per_client.get(client, 0)
            if mine >= self._limits.max_streams_per_client:
                raise AdmissionRefused(
                    f"this client has {mine} streams open, the daemon's limit per client (limits.max_streams_per_client)"
                )
            self._per_client[client] = mine + 1
        return Ticket(lambda: self._leave_client(client))

    def _leave_client(self, client: str) -> None:
        with self._lock:
            left = self._per_client[client] - 1
            if left:
                self._per_client[client] = left
            else:
                del self._per_client[client]

    def open_calls(self) -> tuple[int, int]:
        """(sessions, streams) admitted and not yet released."""
        with self._lock:
            return self._sessions, self._streams
