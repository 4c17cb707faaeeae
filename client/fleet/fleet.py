"""Fleet: the daemons one loader may use, and what it last heard from each.

A loader's ``address=`` names one or more daemons, or a DNS name whose records
are the daemons (``loaderd.wire.addresses``). The fleet keeps one ``Member``
(client/fleet/member.py) per address: up (it described the loader's dataset and
can stream it), or not, and why, which is what ``DaemonUnavailableError`` quotes.
Every daemon must describe the dataset alike (kind, length): the first one heard
is the reference, and one that disagrees is a ``DaemonMismatchError`` naming both.

Who changes what: the loader's constructor calls ``wait_for_one``; during an
epoch a ``FleetMonitor`` thread re-resolves DNS names and probes members that
are not up, and the epoch's iterator marks members down or draining from what
its streams see. The fleet's lock guards the members; probing happens outside it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from loaderd.channel.credentials import Credentials, refusal
from loaderd.channel.rpc_errors import NO_DAEMON_HINT, error_from_rpc, explain_unreachable, is_transient, rpc_summary
from loaderd.channel.threads import track
from loaderd.errors import (
    AuthenticationError,
    DaemonMismatchError,
    DaemonUnavailableError,
    LimitExceededError,
    LoaderdError,
    TransportError,
)
from loaderd.fleet.connection import EXITING, DaemonConnection, get_connection
from loaderd.fleet.member import PROBE_INTERVAL_S, Member, dataset_shape
from loaderd.shm.session import ShmSession
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.addresses import Resolved, Target
from loaderd.wire.limits import PROTOCOL_REVISION, revision_mismatch

log = logging.getLogger("loaderd.fleet")

# How often a DNS name is looked up again.
RESOLVE_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Usable:
    """A member that is up: where a lane can open, and its pool size (its window follows it)."""

    address: str
    pool_workers: int


@dataclass
class Fleet:
    """The members of one loader's target. Thread-safe."""

    target: Target
    dataset: str
    # "auto" | "grpc" | "shm": whether lanes stream through a shared-memory session.
    transport: str
    # TLS and token for every member (one set per loader).
    credentials: Credentials = field(default_factory=Credentials)
    members: dict[str, Member] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.reference: tuple[str, pb.DatasetInfo] | None = None
        # Set when a daemon disagrees with the reference: every further use raises it.
        self.mismatch: DaemonMismatchError | None = None
        self._problems: tuple[str, ...] = ()
        self._resolved_at = 0.0
        self._add(self.target.fixed)

    # ------------------------------------------------------------ membership

    def _add(self, addresses: tuple[str, ...] | list[str], resolved: Resolved | None = None) -> None:
        for address in addresses:
            if address not in self.members:
                self.members[address] = Member(address, get_connection(address, self._credentials_for(address, resolved)))

    def _credentials_for(self, address: str, resolved: Resolved | None) -> Credentials:
        """The loader's credentials; for a daemon found under a DNS name, TLS checks its certificate against that name."""
        name = resolved.name_of(address) if resolved is not None else ""
        return dataclasses.replace(self.credentials, server_name=name) if name and self.credentials.tls else self.credentials

    def refresh(self, force: bool = False) -> bool:
        """Look the target's names up again (at most every RESOLVE_INTERVAL_S); True if the member set changed."""
        if not self.target.dynamic or (not force and time.monotonic() - self._resolved_at < RESOLVE_INTERVAL_S):
            return False
        resolved = self.target.resolve()  # outside the lock: DNS can be slow
        self._resolved_at = time.monotonic()
        with self._lock:
            self._problems = resolved.problems
            if not resolved.addresses and resolved.problems:
                return False  # a failed look-up says nothing about the daemons: keep what we had
            listed = set(resolved.addresses)
            changed = False
            for address, member in self.members.items():
                now_listed = address in listed
                if member.listed != now_listed:
                    member.listed, changed = now_listed, True
                    if not now_listed:
                        member.up, member.reason = False, "no longer listed by DNS"
            # Addresses gone from DNS are forgotten once not up (a lane to one keeps its own connection).
            for address in [a for a, m in self.members.items() if not m.listed and not m.up]:
                del self.members[address]
            new = [a for a in resolved.addresses if a not in self.members]
            self._add(new, resolved)
            return changed or bool(new)

    def usable(self) -> list[Usable]:
        """Members that are up, listed and not draining, in address order."""
        with self._lock:
            return [
                Usable(m.address, m.pool_workers)
                for m in sorted(self.members.values(), key=lambda m: m.address)
                if m.usable
            ]

    def is_usable(self, address: str) -> bool:
        with self._lock:
            member = self.members.get(address)
            return member is not None and member.usable

    def mark_down(self, address: str, reason: str, full: bool = False) -> None:
        """A stream to ``address`` broke, or was refused for a limit (``full``): probe it again until it
        answers, later each time it breaks again without having answered (a daemon that is up but
        fails every stream is not hammered)."""
        with self._lock:
            member = self.members.get(address)
            if member is not None:
                member.broke(reason, full)

    def mark_answering(self, address: str) -> None:
        """A stream to ``address`` delivered: it is healthy again (no backoff)."""
        with self._lock:
            member = self.members.get(address)
            if member is not None:
                member.answering()

    def mark_draining(self, address: str) -> None:
        """``address`` said it is draining: no new work goes there; probes find it when it is back."""
        with self._lock:
            member = self.members.get(address)
            if member is not None:
                member.drains()

    def report(self) -> str:
        """What each address said last, for error messages."""
        with self._lock:
            parts = [f"{m.address}: {m.reason}" for m in sorted(self.members.values(), key=lambda m: m.address)]
            parts.extend(self._problems)
        return "; ".join(parts) or f"{self.target.text} names no daemon"

    # ------------------------------------------------------------ probing

    def probe_due(self) -> bool:
        """Probe every member that is due (down ones often, up ones now and then); True if one came up or went down."""
        now = time.monotonic()
        with self._lock:
            # The long backoff of a full daemon spares the shares it would refuse while others serve;
            # with none up, it is asked at once (it may have room now, and the loader has nowhere else).
            stranded = not any(m.usable for m in self.members.values())
            due = [m for m in self.members.values() if m.listed and (m.next_probe <= now or (stranded and m.full))]
        changed = False
        for member in due:
            changed |= self._probe(member)
        return changed

    def _probe(self, member: Member) -> bool:
        """Ask ``member`` for the dataset (and open its session); True if that changed whether it is usable.

        The change is judged when the answer is written, under the lock: a stream that broke
        while the probe was out (``mark_down``) makes an answering probe a change, so the
        iterator hears that the daemon is back."""
        try:
            describing = member.connection.describe_later(self.dataset)
            session_error: Exception | None = None
            together = self.reference is None
            if together:
                # At construction (nothing heard yet) the description and the session are asked for
                # together: one round trip less before the first batch. What the description says is
                # heard first, as it says more (no such dataset, too old). Later probes are often of
                # daemons that are down: they ask for a session only once the daemon has answered.
                try:
                    self.session_for(member.address)  # opens the session; the member notes the transport
                except (grpc.RpcError, LoaderdError) as exc:
                    session_error = exc
            described = describing.result()
            if described.protocol_revision != PROTOCOL_REVISION:
                return self._probed(member, revision_mismatch(described.protocol_revision, "client"), refused=True)
            if session_error is not None:
                raise session_error
            if not together:
                self.session_for(member.address)
        except grpc.RpcError as exc:
            refused = refusal(exc, member.address, member.connection.credentials)
            if refused is not None:
                return self._probed(member, str(refused), refused=True, error=refused)
            transient = is_transient(exc)
            # Not transient: it answered, and said no (no such dataset, ...).
            reason = explain_unreachable(exc, member.address) if transient else rpc_summary(exc)
            return self._probed(member, reason, refused=not transient, error=None if transient else error_from_rpc(exc, member.address))
        except AuthenticationError as exc:  # the session was refused
            return self._probed(member, str(exc), refused=True, error=exc)
        except TransportError as exc:  # transport="shm" and this daemon's shared memory is out of reach
            return self._probed(member, str(exc), refused=True, error=exc)
        except LoaderdError as exc:
            return self._probed(member, str(exc), refused=False)
        info = described.dataset
        with self._lock:
            if self.reference is None:
                self.reference = (member.address, info)
            ref_address, ref = self.reference
            if ref_address != member.address and (ref.kind, ref.has_length, ref.length) != (info.kind, info.has_length, info.length):
                self.mismatch = self.mismatch or DaemonMismatchError(
                    f"daemons disagree about dataset {self.dataset!r}: {ref_address} serves it as {dataset_shape(ref)}, "
                    f"{member.address} as {dataset_shape(info)}"
                )
                member.reason = f"serves {self.dataset!r} as {dataset_shape(info)}"
                member.next_probe = time.monotonic() + 1.0
                return False
            return member.came_up(described.pool_workers)

    def denied(self) -> AuthenticationError | None:
        """The refusal to raise when no daemon is up and one refused this loader's credentials
        (they go to every daemon alike: waiting for the others cannot help), else None."""
        with self._lock:
            listed = [m for m in self.members.values() if m.listed]
            if any(m.up for m in listed):
                return None
            return next((m.refused for m in listed if isinstance(m.refused, AuthenticationError)), None)

    def _probed(self, member: Member, reason: str, *, refused: bool, error: LoaderdError | None = None) -> bool:
        """``member`` did not come up: why, and when to ask again (a daemon that answered no: less often).
        True if it was up until now."""
        with self._lock:
            return member.not_up(reason, refused=refused, error=error)

    def connection(self, address: str) -> DaemonConnection:
        with self._lock:
            return self.members[address].connection

    def session_for(self, address: str) -> ShmSession | None:
        """The shared-memory session to stream from ``address`` through, or None for plain gRPC.

        The one place the client chooses a daemon's transport: lanes, their calls and the member's
        reason (``over_grpc``) go by what it answers. TransportError where ``transport="shm"``
        cannot work with it; LimitExceededError where it refuses a session (``max_sessions``) to
        ``transport="shm"``.
        """
        if self.transport == "grpc":
            return None
        member = self.members[address]
        try:
            session = member.connection.session()
        except LimitExceededError as exc:
            if self.transport == "shm":
                raise
            # A daemon at max_sessions still serves streams without one, as it does transport="grpc";
            # a later probe or lane asks for a session again.
            if not member.sessionless:  # said once, not at every probe
                log.warning("loaderd at %s refused a session (%s): streaming over gRPC, without shared memory", address, exc)
            member.sessionless = str(exc) or type(exc).__name__
            member.over_grpc = f"it refused a session: {member.sessionless}"
            return None
        member.sessionless = ""
        if session.shm:
            member.over_grpc = ""
            return session
        if self.transport == "shm":
            raise TransportError(f"transport='shm' cannot work with the daemon at {address}: {session.reason}")
        member.over_grpc = session.reason
        return None

    def wait_for_one(self, timeout: float) -> tuple[pb.DatasetInfo, int]:
        """At the loader's construction: the dataset's description and the first daemon's pool size.

        Probes until a daemon answers, for at most ``timeout`` seconds; then
        DaemonUnavailableError naming every address and what it said. Daemons
        that answer in the same round are checked against each other.
        """
        deadline = time.monotonic() + timeout
        self.refresh(force=True)
        warned = False
        while True:
            with self._lock:
                pending = [m for m in self.members.values() if m.listed and not m.up]
            for member in pending:
                self._probe(member)
            if self.mismatch is not None:
                raise self.mismatch
            usable = self.usable()
            if usable and self.reference is not None:
                return self.reference[1], usable[0].pool_workers
            with self._lock:
                listed = [m for m in self.members.values() if m.listed]
                refusals = [m.refused for m in listed if m.refused is not None]
            denied = self.denied()
            if denied is not None:
                raise denied
            if listed and len(refusals) == len(listed):
                raise refusals[0]  # every daemon answered and said no: that, not their absence, is the problem
            if time.monotonic() >= deadline:
                raise DaemonUnavailableError(
                    f"no loaderd serving {self.dataset!r} answered within {timeout:g}s (failover_timeout); "
                    f"tried {self.report()}. {NO_DAEMON_HINT}"
                )
            if not warned:
                # Said at once: a newcomer must not sit through the whole window wondering.
                warned = True
                log.warning(
                    "loaderd: no daemon serving %r answers yet (%s); retrying for up to %gs (failover_timeout). %s",
                    self.dataset,
                    self.report(),
                    timeout,
                    NO_DAEMON_HINT,
                )
            time.sleep(PROBE_INTERVAL_S)
            self.refresh()


class FleetMonitor:
    """During an epoch: re-resolves the target and probes members that are down; ``wake`` when one comes up.

    One thread, stopped with ``stop`` (set by the epoch's iterator when it
    closes, and by its finalizer if the iterator is dropped).
    """

    def __init__(self, fleet: Fleet, wake: Callable[[], None], stop: threading.Event) -> None:
        self._fleet = fleet
        self._wake = wake
        self._stop = stop
        self.thread = threading.Thread(target=self._run, name="loaderd-fleet", daemon=True)
        track(self.thread)  # joined at the process's exit, where a dropped iterator's monitor has no owner left

    def _run(self) -> None:
        fleet = self._fleet
        failing = ""  # the failure already logged, while it repeats every round
        while not self._stop.wait(PROBE_INTERVAL_S) and not EXITING.is_set():
            try:
                changed = fleet.refresh()
                changed |= fleet.probe_due()
                failing = ""
            except Exception as exc:  # a probe must never take the epoch down with it
                if self._stop.is_set() or EXITING.is_set():
                    return  # e.g. the channels closed under the round at interpreter exit
                # Probes map what daemons say themselves: what gets here is unexpected (a bug, say),
                # so it is logged with its traceback, once per spell rather than every 0.1 s.
                failure = f"{type(exc).__name__}: {exc}"
                if failure != failing:
                    log.warning("probing daemons failed; the loader goes on with those it has: %s", failure, exc_info=True)
                failing = failure
                changed = True  # let the iterator look (a TransportError shows there)
            if changed or fleet.mismatch is not None:
                self._wake()
