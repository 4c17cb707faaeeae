"""The daemon's status snapshot: what `loaderd status` prints and the metrics export."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from google.protobuf.message import Message

from loaderd.server.cache.auto import ON, CacheDecision
from loaderd.server.cache.usage import CacheLocation, store_usage
from loaderd.server.config.sizes import human_bytes
from loaderd.server.scheduling.catalog import Catalog, dataset_info
from loaderd.server.scheduling.snapshot import DatasetCounters
from loaderd.v1 import loaderd_pb2 as pb

if TYPE_CHECKING:
    from loaderd.server.pool.pool import WorkerState
    from loaderd.server.rpc.sessions import SessionRegistry
    from loaderd.server.scheduling.scheduler import Scheduler


@functools.cache
def version() -> str:
    """The installed loaderd package's version."""
    # Imported on the first Status call, not with the daemon: importlib.metadata (email, zipfile, csv...) is ~1.8 MB.
    import importlib.metadata

    try:
        return importlib.metadata.version("loaderd")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


class StatusBoard:
    """Takes the daemon's status snapshot (the ``Status`` RPC, ``loaderd status``, metrics) from each part's owner."""

    def __init__(
        self,
        workers: Callable[[], list[WorkerState]],
        catalog: Catalog,
        scheduler: Scheduler,
        sessions: SessionRegistry,
        caches: Mapping[str, CacheLocation] | None = None,
    ) -> None:
        """``caches``: the item cache of each dataset that has one (its store is read for its size)."""
        self._workers = workers
        self._catalog = catalog
        self._scheduler = scheduler
        self._sessions = sessions
        self._caches = dict(caches or {})

    def snapshot(self) -> pb.StatusResponse:
        """A consistent snapshot of the pool, datasets, shares and streams."""
        # Each part's figures come from its own snapshot: this takes no lock of theirs.
        reply = pb.StatusResponse(
            version=version(), sessions=self._sessions.open_count(), paused_sessions=self._sessions.paused_count()
        )
        known = self._catalog.datasets
        taken = self._scheduler.snapshot()
        reply.uptime_s = taken.taken_at - taken.started_at
        size, view = self._catalog.pool_size, taken.pool
        reply.pool.CopyFrom(
            pb.PoolStatus(
                workers=taken.members,
                min_workers=view.least if view is not None else size,
                max_workers=size,
                elastic=view is not None,
                target=view.target if view is not None else size,
                reason=view.reason if view is not None else "",
                held=view.held if view is not None else "",
                starved_s=taken.starved_s,
                busy_s=taken.busy_s,
                limited_s=view.limited_s if view is not None else taken.starved_s,
            )
        )
        for state in self._workers():
            reply.workers.add(
                worker_id=state.worker_id,
                pid=state.pid,
                alive=state.alive,
                ready=state.ready,
                busy=taken.busy.get(state.worker_id, 0),
                restarts=state.restarts,
                batches=taken.worker_batches.get(state.worker_id, 0),
            )
        datasets: dict[str, pb.DatasetStatus] = {}
        for name in sorted(set(known) | set(taken.counters)):
            meta = known.get(name)
            counters = taken.counters.get(name)
            entry = datasets[name] = reply.datasets.add()
            entry.info.CopyFrom(dataset_info(name, meta) if meta is not None else pb.DatasetInfo(name=name))
            if counters is not None:
                entry.batches_computed = counters.batches_computed
                entry.samples_fetched = counters.samples_fetched
                entry.errors = counters.errors
                entry.batches_delivered = counters.delivered_closed
            location = self._caches.get(name)
            if location is not None:
                entry.cache.CopyFrom(cache_status(location, counters, taken.caches.get(name)))
        for stream in sorted(taken.streams, key=lambda s: s.stream_id):
            spec = stream.spec
            entry = datasets.get(spec.dataset)
            if entry is not None:
                entry.batches_delivered += stream.delivered
                entry.open_streams += 1
                entry.queued += stream.queued
            reply.streams.add(
                stream_id=stream.stream_id,
                peer=spec.peer,
                client=spec.client,
                identity=spec.identity,
                dataset=spec.dataset,
                window=spec.window,
                delivered=stream.delivered,
                consumed=stream.consumed,
                in_flight=stream.in_flight,
                stalled_s=stream.stalled_us / 1e6,
                open_s=taken.taken_at - stream.opened_at,
                share=spec.share or "",
                shm=spec.session_id != 0,
            )
        reply.clients.extend(taken.clients)
        for job in sorted(taken.jobs, key=lambda j: (j.name, j.epoch)):
            entry = datasets.get(job.dataset)
            if entry is not None:
                entry.queued += job.queued
            reply.shares.add(
                name=job.name,
                epoch=job.epoch,
                dataset=job.dataset,
                consumers=job.consumers,
                produced=job.produced,
                recomputed=job.recomputed,
                buffered=job.buffered,
            )
        return reply


# ------------------------------------------------------------ rates (`loaderd status`, `--watch`)


@dataclass(frozen=True)
class ClientRate:
    """A client's pace on a dataset: the batches it took per second, and how much of the time it waited."""

    batches_s: float
    # The share of the time the client spent blocked in next() waiting for a batch (it reports this
    # itself): near 1, the trainer is input-bound (starved); near 0, the data keeps up.
    waiting: float


ClientKey = tuple[str, str]  # (client, dataset)


def client_rates(previous: pb.StatusResponse | None, current: pb.StatusResponse, elapsed_s: float) -> dict[ClientKey, ClientRate]:
    """Each of ``current``'s clients' rate since ``previous`` (taken ``elapsed_s`` earlier), or over the time
    its streams were open where it is new or there is no ``previous``."""
    before = {(c.client, c.dataset): c for c in previous.clients} if previous is not None else {}
    rates: dict[ClientKey, ClientRate] = {}
    for client in current.clients:
        old = before.get((client.client, client.dataset))
        if old is None or elapsed_s <= 0:
            span, taken, waited = client.active_s, client.batches, client.waited_s
        else:  # streams that opened and closed within the interval count too
            span, taken, waited = elapsed_s, client.batches - old.batches, client.waited_s - old.waited_s
        span = max(span, 1e-6)
        rates[(client.client, client.dataset)] = ClientRate(max(0.0, taken / span), min(1.0, max(0.0, waited / span)))
    return rates


# ------------------------------------------------------------ showing it (`loaderd status`)


def status_dict(message: Message) -> dict[str, Any]:
    """A message as plain JSON-ready values (unlike json_format, 64-bit integers stay numbers)."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.enum_type is not None:
            out[field.name] = field.enum_type.values_by_number[value].name
        elif field.message_type is not None:
            out[field.name] = [status_dict(v) for v in value] if field.is_repeated else status_dict(value)
        else:
            out[field.name] = list(value) if field.is_repeated else value
    return out


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()
        for row in cells
    ]
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def status_json(status: pb.StatusResponse, rates: dict[ClientKey, ClientRate]) -> dict[str, Any]:
    """``status`` as JSON-ready values, each client with its ``batches_s`` and ``waiting`` from ``rates``."""
    out = status_dict(status)
    for client in out["clients"]:
        rate = rates.get((client["client"], client["dataset"]))
        if rate is not None:
            client.update(batches_s=round(rate.batches_s, 3), waiting=round(rate.waiting, 4))
    return out


def cache_status(location: CacheLocation, counters: DatasetCounters | None, decision: CacheDecision | None = None) -> pb.CacheStatus:
    """A dataset's cache as status shows it: the store's size now, this daemon's counts, and (``cache: auto``) its decision."""
    usage = store_usage(location.path)
    status = pb.CacheStatus(tier=location.tier, capacity_bytes=location.capacity_bytes, mode=decision.mode if decision else ON)
    if decision is not None:
        status.decision = decision.reason
    if usage is not None:
        status.used_bytes, status.items = usage.used_bytes, usage.items
    if counters is not None:
        status.hits, status.misses, status.not_stored = counters.cache_hits, counters.cache_misses, counters.cache_not_stored
        if counters.cache_misses:
            status.saved_cpu_s = counters.cache_hits * counters.cache_miss_cpu_s / counters.cache_misses
    return status


def format_status(status: pb.StatusResponse, rates: dict[ClientKey, ClientRate] | None = None) -> str:
    """The human-readable tables `loaderd status` prints; clients' rates over their streams' open time unless ``rates`` is given."""
    rates = client_rates(None, status, 0.0) if rates is None else rates
    sessions = f"{status.sessions} shared-memory session{'s' * (status.sessions != 1)}"
    if status.paused_sessions:
        sessions += f" ({status.paused_sessions} more paused: their processes live but their calls ended)"
    parts = [f"loaderd {status.version}, up {_duration(status.uptime_s)}, {sessions}"]
    pool = status.pool
    if pool.elastic:
        workers = f"{pool.workers} worker{'s' * (pool.workers != 1)}"
        line = f"pool: {workers} (elastic, {pool.min_workers} to {pool.max_workers}; target {pool.target}): {pool.reason}"
        parts[0] += "\n" + line + (f"\nnot growing: {pool.held}" if pool.held else "")
    parts.append(
        _table(
            ["WORKER", "PID", "ALIVE", "READY", "BUSY", "RESTARTS", "BATCHES"],
            [[w.worker_id, w.pid, _yes(w.alive), _yes(w.ready), w.busy, w.restarts, w.batches] for w in status.workers],
        )
    )
    parts.append(
        _table(
            ["DATASET", "KIND", "ITEMS", "STREAMS", "QUEUED", "COMPUTED", "DELIVERED", "SAMPLES", "ERRORS"],
            [
                [
                    d.info.name,
                    "iterable" if d.info.kind == pb.DatasetInfo.ITERABLE else "map",
                    d.info.length if d.info.has_length else "-",
                    d.open_streams,
                    d.queued,
                    d.batches_computed,
                    d.batches_delivered,
                    d.samples_fetched,
                    d.errors,
                ]
                for d in status.datasets
            ],
        )
    )
    cached = [d for d in status.datasets if d.HasField("cache")]
    if cached:
        rows = []
        for d in cached:
            c = d.cache
            lookups = c.hits + c.misses
            rows.append([
                d.info.name, c.tier, c.mode or ON, c.items, f"{human_bytes(c.used_bytes)} of {human_bytes(c.capacity_bytes)}",
                f"{c.hits / lookups:.0%}" if lookups else "-", c.hits, c.misses, _duration(c.saved_cpu_s), c.not_stored,
            ])
        decided = "".join(f"\ncache: auto for {d.info.name!r}: {d.cache.decision}" for d in cached if d.cache.decision)
        parts.append(
            _table(["CACHE", "TIER", "MODE", "ITEMS", "SIZE", "HIT RATE", "HITS", "MISSES", "CPU SAVED", "NOT STORED"], rows)
            + "\nCPU SAVED: hits times the mean CPU time of a miss (the dataset's __getitem__)"
            + decided
        )
    if status.clients:
        rows = []
        for c in status.clients:
            rate = rates.get((c.client, c.dataset), ClientRate(0.0, 0.0))
            rows.append([c.client or "-", c.identity or "-", c.dataset, c.open_streams, c.batches, round(rate.batches_s, 1), f"{rate.waiting:.0%}"])
        parts.append(
            _table(["CLIENT", "IDENTITY", "DATASET", "STREAMS", "BATCHES", "BATCH/S", "WAITING"], rows)
            + "\nWAITING: the share of its time the client waited for batches (high: that trainer is input-bound)"
        )
    if status.streams:
        headers = ["STREAM", "CLIENT", "IDENTITY", "PEER", "DATASET", "WINDOW", "DELIVERED", "CONSUMED", "IN-FLIGHT", "STALL"]
        parts.append(
            _table(
                [*headers, "OPEN", "SHARE", "SHM"],
                [
                    [
                        s.stream_id, s.client or "-", s.identity or "-", s.peer, s.dataset, s.window, s.delivered, s.consumed,
                        s.in_flight, _duration(s.stalled_s), _duration(s.open_s), s.share or "-", _yes(s.shm),
                    ]
                    for s in status.streams
                ],
            )
        )
    else:
        parts.append("no open streams")
    if status.shares:
        parts.append(
            _table(
                ["SHARE", "EPOCH", "DATASET", "CONSUMERS", "PRODUCED", "RECOMPUTED", "BUFFERED"],
                [[j.name, j.epoch, j.dataset, j.consumers, j.produced, j.recomputed, j.buffered] for j in status.shares],
            )
        )
    return "\n\n".join(parts)
