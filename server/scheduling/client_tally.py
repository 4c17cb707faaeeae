"""What each client took from each dataset and how long it waited, across its streams.

A stream lives for one epoch, so a training process opens one after another;
``loaderd status`` and the metrics show a client's pace over all of them. The
scheduler tells ``ClientTally.closed`` of every stream it closes, and the status
board adds the open streams' running figures (``ClientTally.rows``). A client's
entry is forgotten ``KEEP_S`` after its last stream closed, unless it has one
open again (its figures must not go backwards: they are Prometheus counters);
at most ``MAX_CLIENTS`` idle entries are kept (the oldest go first), so a
stream of short-lived clients cannot grow the daemon.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from loaderd.v1 import loaderd_pb2 as pb

KEEP_S = 600.0
MAX_CLIENTS = 4096


@dataclass(frozen=True)
class StreamUse:
    """One stream's share of its client's figures: the batches sent to it, the time its client waited, the time it was open."""

    client: str
    identity: str
    dataset: str
    batches: int
    waited_s: float
    active_s: float


@dataclass
class _Totals:
    identity: str
    batches: int = 0
    waited_s: float = 0.0
    active_s: float = 0.0
    closed_at: float = 0.0


class ClientTally:
    """Totals of closed streams per (client, dataset). Not thread-safe: the scheduler calls it under its lock."""

    def __init__(self) -> None:
        self._totals: dict[tuple[str, str], _Totals] = {}

    def closed(self, use: StreamUse, now: float, open_keys: Collection[tuple[str, str]]) -> None:
        """Add a closed stream's figures to its client's; ``open_keys``: the (client, dataset) of every open stream."""
        key = (use.client, use.dataset)
        totals = self._totals.pop(key, None) or _Totals(use.identity)
        totals.batches += use.batches
        totals.waited_s += use.waited_s
        totals.active_s += use.active_s
        totals.closed_at = now
        self._totals[key] = totals  # re-inserted: the dict stays ordered oldest-closed first
        self._forget(now, open_keys)

    def _forget(self, now: float, open_keys: Collection[tuple[str, str]]) -> None:
        """Drop idle entries past ``KEEP_S``, then the oldest idle ones beyond ``MAX_CLIENTS``.

        Entries are in the order their last stream closed, so the walk stops at the first young
        one once no excess is left (it runs under the scheduler's lock: no scan of every entry)."""
        excess = len(self._totals) - MAX_CLIENTS
        doomed: list[tuple[str, str]] = []
        for key, totals in self._totals.items():
            if excess <= len(doomed) and now - totals.closed_at < KEEP_S:
                break
            if key not in open_keys:
                doomed.append(key)
        for key in doomed:
            del self._totals[key]

    def rows(self, open_streams: Iterable[StreamUse], now: float) -> list[pb.ClientStatus]:
        """Every client's figures: its closed streams' totals plus its open streams' running ones."""
        open_streams = list(open_streams)
        self._forget(now, {(use.client, use.dataset) for use in open_streams})
        rows: dict[tuple[str, str], pb.ClientStatus] = {}
        for (client, dataset), totals in self._totals.items():
            rows[(client, dataset)] = pb.ClientStatus(
                client=client,
                identity=totals.identity,
                dataset=dataset,
                batches=totals.batches,
                waited_s=totals.waited_s,
                active_s=totals.active_s,
            )
        for use in open_streams:
            row = rows.setdefault((use.client, use.dataset), pb.ClientStatus(client=use.client, identity=use.identity, dataset=use.dataset))
            row.open_streams += 1
            row.batches += use.batches
            row.waited_s += use.waited_s
            row.active_s += use.active_s
        return sorted(rows.values(), key=lambda r: (r.client, r.dataset))
