"""Admission: how many long-lived calls clients hold open, and refusing what is over the limits.

Every ``Session``, ``StreamBatches`` and health ``Watch`` call holds one gRPC
handler thread for its whole life. Each kind has a budget (``Budget``), and a
call is counted against it from its first instant, before its first message,
by who it comes from (``Peer``):

- in all: ``limits.max_sessions``, ``limits.max_streams``, ``limits.max_watches``;
- per host (the peer's address without its port; an IPv6 host is its /64): the total less a reserve of
  an eighth (``RESERVE_FRACTION``), which no single host can take, so another
  host always gets in however many calls one host holds;
- per connection (address and port): ``limits.max_streams_per_client`` streams,
  ``SESSIONS_PER_CONNECTION`` sessions (a client process opens one per
  daemon), ``WATCHES_PER_CONNECTION`` watches.

A stream is counted once more when its ``open`` says whose it is: against its
session's ``limits.max_streams_per_client`` (``admit_client_stream``).

On a unix socket every connection has the same peer (``unix:``, no address), so
its callers share one host budget and no connection limit applies: the socket
is private to the daemon's user (and group), who can stop the daemon anyway.

The thread pool is sized above the three totals, so short calls (health
Check, Status, ListDatasets) always find a thread. A refusal is an
``AdmissionRefused`` naming the limit (RESOURCE_EXHAUSTED on the wire). Each
admission returns a ``Ticket`` whose ``release`` is idempotent, so the call's
end and its context callback may both release it.
"""

from __future__ import annotations

import ipaddress
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from loaderd.errors import LimitExceededError
from loaderd.server.config.schema import Limits

# Threads beyond the long-lived calls' limits, for short calls and refusals.
SHORT_CALL_THREADS = 64
# One host may hold all but this fraction of each total (a reserve for the other hosts).
RESERVE_FRACTION = 8
# A client process opens one session per daemon on its connection; a few more ride out a reconnect.
SESSIONS_PER_CONNECTION = 16
# Tools watch the health of a service or two.
WATCHES_PER_CONNECTION = 4


def handler_threads(limits: Limits) -> int:
    """How many gRPC handler threads the daemon needs for ``limits``."""
    return limits.max_sessions + limits.max_streams + limits.max_watches + SHORT_CALL_THREADS


class AdmissionRefused(LimitExceededError):
    """Over one of the daemon's admission limits (calls open, in all, per host or per client): the client
    hears ``Reason.ADMISSION_LIMIT``, and another daemon may take the call."""


@dataclass(frozen=True)
class Peer:
    """Who a call comes from, as far as its first instant tells: its host, and its connection where it has one."""

    host: str  # "ipv4:10.0.0.2", "ipv6:fd00::/64", "unix"
    connection: str | None  # gRPC's peer ("ipv4:10.0.0.2:51234"); None on a unix socket, where all look alike

    @classmethod
    def of(cls, peer: str) -> Peer:
        """The ``Peer`` of gRPC's ``context.peer()`` string.

        An IPv6 host is its /64 (one machine commonly has a whole /64 to pick addresses from),
        and an IPv4-mapped IPv6 address is the IPv4 host it maps."""
        kind, _, rest = peer.partition(":")
        if kind not in ("ipv4", "ipv6"):
            return cls(host=kind or "unknown", connection=None)
        host, colon, port = rest.rpartition(":")
        if not (colon and host and port.isdigit()):
            return cls(host=peer, connection=peer)
        if kind == "ipv6":
            try:
                address = ipaddress.IPv6Address(host.strip("[]").split("%", 1)[0])
            except ValueError:
                return cls(host=f"{kind}:{host}", connection=peer)
            if address.ipv4_mapped is not None:
                return cls(host=f"ipv4:{address.ipv4_mapped}", connection=peer)
            return cls(host=f"ipv6:{ipaddress.IPv6Network((address, 64), strict=False)}", connection=peer)
        return cls(host=f"{kind}:{host}", connection=peer)


class CallKind(Enum):
    """The long-lived calls admission counts."""

    SESSION = "sessions"
    STREAM = "streams"
    WATCH = "health watches"


@dataclass(frozen=True)
class Budget:
    """One kind of call's limits: in all (``total``, the config key ``key``), per host, and per connection."""

    kind: CallKind
    total: int
    key: str  # "limits.max_streams"
    per_connection: int
    per_connection_key: str  # how the per-connection limit is set, for the refusal

    @property
    def per_host(self) -> int:
        """The total less the reserve one host cannot take (all of it when the total is under the fraction)."""
        return max(1, self.total - self.total // RESERVE_FRACTION)


def budgets(limits: Limits) -> dict[CallKind, Budget]:
    """The three budgets ``limits`` sets."""
    return {
        CallKind.SESSION: Budget(
            CallKind.SESSION, limits.max_sessions, "limits.max_sessions", SESSIONS_PER_CONNECTION, "one process's sessions, a fixed bound"
        ),
        CallKind.STREAM: Budget(
            CallKind.STREAM, limits.max_streams, "limits.max_streams", limits.max_streams_per_client, "limits.max_streams_per_client"
        ),
        CallKind.WATCH: Budget(CallKind.WATCH, limits.max_watches, "limits.max_watches", WATCHES_PER_CONNECTION, "a fixed bound"),
    }


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


class _Open:
    """The calls of one kind open now: in all, by host, by connection."""

    def __init__(self) -> None:
        self.total = 0
        self.hosts: Counter[str] = Counter()
        self.connections: Counter[str] = Counter()

    def refusal(self, budget: Budget, peer: Peer) -> str | None:
        """Why one more call from ``peer`` is over ``budget``, or None."""
        what = budget.kind.value
        if self.total >= budget.total:
            return f"the daemon has {self.total} {what} open, its limit ({budget.key})"
        held = self.hosts[peer.host]
        if held >= budget.per_host:
            return f"{peer.host} has {held} {what} open, the most one host may hold ({budget.key} less the 1/{RESERVE_FRACTION} kept for other hosts)"
        if peer.connection is not None:
            mine = self.connections[peer.connection]
            if mine >= budget.per_connection:
                return f"this connection ({peer.connection}) has {mine} {what} open, the limit per connection ({budget.per_connection_key})"
        return None

    def add(self, peer: Peer, step: int) -> None:
        self.total += step
        for counter, key in ((self.hosts, peer.host), (self.connections, peer.connection)):
            if key is not None:
                counter[key] += step
                if counter[key] <= 0:
                    del counter[key]


class Admission:
    """Counts open sessions, streams and watches (in all, per host, per connection, per client) against ``limits``."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._budgets = budgets(limits)
        self._lock = threading.Lock()
        self._open = {kind: _Open() for kind in CallKind}
        self._per_client: dict[str, int] = {}

    def admit(self, kind: CallKind, peer: str) -> Ticket:
        """A new call of ``kind`` from gRPC peer ``peer``, counted from its start (before its first message)."""
        who = Peer.of(peer)
        budget = self._budgets[kind]
        with self._lock:
            calls = self._open[kind]
            refusal = calls.refusal(budget, who)
            if refusal is not None:
                raise AdmissionRefused(refusal)
            calls.add(who, 1)
        return Ticket(lambda: self._leave(kind, who))

    def _leave(self, kind: CallKind, who: Peer) -> None:
        with self._lock:
            self._open[kind].add(who, -1)

    def admit_session(self, peer: str) -> Ticket:
        return self.admit(CallKind.SESSION, peer)

    def admit_stream(self, peer: str) -> Ticket:
        return self.admit(CallKind.STREAM, peer)

    def admit_watch(self, peer: str) -> Ticket:
        return self.admit(CallKind.WATCH, peer)

    def admit_client_stream(self, client: str) -> Ticket:
        """The stream (already admitted) turned out to be ``client``'s (a session or connection key)."""
        with self._lock:
            mine = self._per_client.get(client, 0)
            if mine >= self._limits.max_streams_per_client:
                raise AdmissionRefused(f"this client has {mine} streams open, the daemon's limit per client (limits.max_streams_per_client)")
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
            return self._open[CallKind.SESSION].total, self._open[CallKind.STREAM].total
