"""The daemon's status snapshot: what `loaderd status` prints (filled in by issue 4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loaderd.v1 import loaderd_pb2 as pb

if TYPE_CHECKING:
    from loaderd.server.scheduler import Scheduler
    from loaderd.server.sessions import SessionRegistry


def build_status(scheduler: Scheduler, sessions: SessionRegistry) -> pb.StatusResponse:
    """A consistent snapshot of the pool, datasets, shares and streams."""
    return pb.StatusResponse()
