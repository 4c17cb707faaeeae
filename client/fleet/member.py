"""Member: one daemon of a loader's fleet, as the loader knows it, and when to ask it again.

What the loader hears of a daemon changes its member: a probe's answer (``came_up``,
``not_up``), a stream that broke or was refused for the daemon's limits (``broke``),
one that delivered (``answering``), a drain (``draining``). Each sets when the
monitor asks the daemon again: often while it is down, later each time its streams
break again (a daemon that is up but fails every stream is not hammered), now and then
while it is up. The fleet calls these under its lock (client/fleet/fleet.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from loaderd.errors import LoaderdError
from loaderd.fleet.connection import DaemonConnection
from loaderd.v1 import loaderd_pb2 as pb

# How often a member that is down is asked again, and one that is up checked.
PROBE_INTERVAL_S = 0.1
RECHECK_INTERVAL_S = 2.0
# A daemon whose streams break again and again is asked again later each time, up to this.
MAX_BACKOFF_S = 2.0
# The same for a daemon that keeps refusing streams for its limits (max_streams): it answers probes,
# so only a stream finds it full, and each try costs a share's consumers a move there and back.
MAX_FULL_BACKOFF_S = 30.0


def dataset_shape(info: pb.DatasetInfo) -> str:
    """How a daemon serves a dataset, in words: what daemons must agree on."""
    kind = "an IterableDataset" if info.kind == pb.DatasetInfo.ITERABLE else "map-style"
    return f"{kind} with {info.length} items" if info.has_length else f"{kind} without a length"


@dataclass
class Member:
    """One daemon address and what the loader knows of it."""

    address: str
    connection: DaemonConnection
    up: bool = False
    draining: bool = False
    reason: str = "not tried yet"
    pool_workers: int = 1
    # Listed by the last look-up (a DNS name's records can drop it).
    listed: bool = True
    next_probe: float = 0.0
    # Streams to it that broke since one last answered (the backoff before asking it again).
    losses: int = 0
    # Why it cannot serve the loader although it answered (no such dataset, too old, transport); None: it could.
    refused: LoaderdError | None = None
    # Why it refused a session (max_sessions) while "auto" streams from it over gRPC; "": it did not.
    sessionless: str = ""
    # Why "auto" streams from it over gRPC, as ``Fleet.session_for`` last decided ("": through shared memory).
    over_grpc: str = ""
    # Down because it refused a stream for its limits (its backoff runs to MAX_FULL_BACKOFF_S).
    full: bool = False

    @property
    def usable(self) -> bool:
        """Up, listed and not draining: where a lane may open."""
        return self.up and self.listed and not self.draining

    def broke(self, reason: str, full: bool) -> None:
        """A stream to it broke, or was refused for a limit (``full``): down, asked again after its backoff."""
        self.losses += 1
        self.up, self.reason = False, reason
        self.full = full
        most = MAX_FULL_BACKOFF_S if full else MAX_BACKOFF_S
        self.next_probe = time.monotonic() + min(most, PROBE_INTERVAL_S * 2 ** (self.losses - 1))

    def answering(self) -> None:
        """A stream to it delivered: it is healthy again (no backoff)."""
        self.losses = 0

    def drains(self) -> None:
        """It said it is draining: no new work goes there; probes find it when it is back."""
        self.up, self.draining, self.reason, self.next_probe = False, True, "draining", 0.0

    def not_up(self, reason: str, *, refused: bool, error: LoaderdError | None = None) -> bool:
        """A probe found it down (or answering no, ``refused``: asked again less often); True if it was up until now."""
        changed = self.up
        self.up, self.reason = False, reason
        self.refused = (error or LoaderdError(f"loaderd at {self.address} {reason}")) if refused else None
        self.next_probe = time.monotonic() + (1.0 if refused else PROBE_INTERVAL_S)
        return changed

    def came_up(self, pool_workers: int) -> bool:
        """A probe found it serving the dataset; True if it was down or draining until now. Its reason quotes
        the transport ``Fleet.session_for`` chose (``over_grpc``)."""
        changed = not self.up or self.draining
        self.pool_workers = max(1, pool_workers)
        self.up, self.draining, self.refused = True, False, None
        self.next_probe = time.monotonic() + RECHECK_INTERVAL_S
        self.reason = f"up (gRPC transport: {self.over_grpc})" if self.over_grpc else "up"
        return changed
