"""Prometheus metrics: a per-daemon registry served over HTTP.

Batch latency is the one thing observed as it happens (``BatchLatency``, the
scheduler's ``on_batch`` observer, feeds a histogram). Everything else is read
at scrape time from the same snapshot ``loaderd status`` shows
(``StatusBoard.snapshot``), so the two always agree and nothing is counted twice.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from loaderd.server.security.auth import Authenticator
from loaderd.v1 import loaderd_pb2 as pb

# From a tiny in-memory batch (~1 ms) to a slow decode-and-augment one (tens of seconds).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# How long shutdown waits for the HTTP thread (serve_forever polls every 0.5 s).
_STOP_TIMEOUT_S = 5.0

# (metric, DatasetStatus field, family, help) exported per dataset.
_PER_DATASET: tuple[tuple[str, str, type[CounterMetricFamily] | type[GaugeMetricFamily], str], ...] = (
    ("loaderd_batches_computed", "batches_computed", CounterMetricFamily, "Batches the pool computed (shared: once)"),
    ("loaderd_batches_delivered", "batches_delivered", CounterMetricFamily, "Batches sent to clients"),
    ("loaderd_samples_fetched", "samples_fetched", CounterMetricFamily, "Samples fetched by the pool"),
    ("loaderd_batch_errors", "errors", CounterMetricFamily, "Batches that raised in user code"),
    ("loaderd_queue_depth", "queued", GaugeMetricFamily, "Tasks waiting for a worker"),
    ("loaderd_open_streams", "open_streams", GaugeMetricFamily, "Open client streams"),
)
# (metric, CacheStatus field, family, help) exported per dataset with a cache: (config `cache:`).
CACHE_METRICS: tuple[tuple[str, str, type[CounterMetricFamily] | type[GaugeMetricFamily], str], ...] = (
    ("loaderd_cache_hits", "hits", CounterMetricFamily, "Items the pool took from the item cache"),
    ("loaderd_cache_misses", "misses", CounterMetricFamily, "Items the pool computed (not in the item cache)"),
    ("loaderd_cache_saved_cpu_seconds", "saved_cpu_s", CounterMetricFamily, "CPU time the cache's hits saved (estimate)"),
    ("loaderd_cache_not_stored", "not_stored", CounterMetricFamily, "Items the cache did not keep (full, or not encodable)"),
    ("loaderd_cache_items", "items", GaugeMetricFamily, "Items in the item cache's store"),
    ("loaderd_cache_used_bytes", "used_bytes", GaugeMetricFamily, "Bytes the item cache's store takes"),
    ("loaderd_cache_capacity_bytes", "capacity_bytes", GaugeMetricFamily, "The item cache's bound (config cache: max)"),
)


class _StatusCollector(Collector):
    """Counters and gauges derived from one status snapshot per scrape."""

    def __init__(self, snapshot: Callable[[], pb.StatusResponse]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        status = self._snapshot()
        for name, field, kind, doc in _PER_DATASET:
            family = kind(name, doc, labels=["dataset"])
            for dataset in status.datasets:
                family.add_metric([dataset.info.name], getattr(dataset, field))
            yield family
        for name, field, kind, doc in CACHE_METRICS:
            family = kind(name, doc, labels=["dataset", "tier"])
            for dataset in status.datasets:
                if dataset.HasField("cache"):
                    family.add_metric([dataset.info.name, dataset.cache.tier], getattr(dataset.cache, field))
            yield family
        on = GaugeMetricFamily(
            "loaderd_cache_on", "1 while the item cache is used (fixed; cache: auto measuring or decided on)", labels=["dataset", "tier"]
        )
        for dataset in status.datasets:
            if dataset.HasField("cache"):
                on.add_metric([dataset.info.name, dataset.cache.tier], float(dataset.cache.mode != "off"))
        yield on

        labels = ["client", "identity", "stream", "dataset"]
        delivered = CounterMetricFamily("loaderd_client_batches_delivered", "Batches sent on a stream", labels=labels)
        stalled = CounterMetricFamily("loaderd_client_stall_seconds", "Time the client reported waiting for batches", labels=labels)
        in_flight = GaugeMetricFamily("loaderd_client_in_flight", "Batches computing or ready to send on a stream", labels=labels)
        for stream in status.streams:
            key = [stream.client, stream.identity, str(stream.stream_id), stream.dataset]
            delivered.add_metric(key, stream.delivered)
            stalled.add_metric(key, stream.stalled_s)
            in_flight.add_metric(key, stream.in_flight)
        yield from (delivered, stalled, in_flight)

        # Per training process and dataset, across its streams (epochs): what rate() and dashboards want.
        labels = ["client", "identity", "dataset"]
        taken = CounterMetricFamily("loaderd_client_batches", "Batches sent to a client, over all its streams", labels=labels)
        waited = CounterMetricFamily(
            "loaderd_client_waited_seconds", "Seconds a client reported waiting for batches, over all its streams", labels=labels
        )
        active = CounterMetricFamily("loaderd_client_active_seconds", "Seconds a client's streams were open, summed", labels=labels)
        for client in status.clients:
            key = [client.client, client.identity, client.dataset]
            taken.add_metric(key, client.batches)
            waited.add_metric(key, client.waited_s)
            active.add_metric(key, client.active_s)
        yield from (taken, waited, active)

        workers = status.workers
        yield CounterMetricFamily("loaderd_worker_restarts", "Pool workers replaced after dying", value=sum(w.restarts for w in workers))
        pool = status.pool
        yield GaugeMetricFamily("loaderd_workers", "Pool size: workers in the pool now (an elastic pool's current size)", value=pool.workers)
        yield GaugeMetricFamily("loaderd_workers_target", "The size an elastic pool is heading to (a fixed pool's size)", value=pool.target)
        yield GaugeMetricFamily("loaderd_workers_min", "The pool's fewest workers (a fixed pool's size)", value=pool.min_workers)
        yield GaugeMetricFamily("loaderd_workers_max", "The pool's most workers (a fixed pool's size)", value=pool.max_workers)
        yield CounterMetricFamily(
            "loaderd_pool_starved_seconds",
            "Seconds tasks waited for a worker with every worker busy (its rate: the share of time the pool held trainers back)",
            value=pool.starved_s,
        )
        yield CounterMetricFamily(
            "loaderd_pool_limited_seconds",
            "Of those, seconds the pool could not grow (fixed, at its max, or held): the rate more daemons would relieve",
            value=pool.limited_s,
        )
        yield CounterMetricFamily("loaderd_pool_busy_seconds", "Worker-seconds spent on tasks", value=pool.busy_s)
        yield GaugeMetricFamily("loaderd_workers_alive", "Pool workers alive", value=sum(w.alive for w in workers))
        yield GaugeMetricFamily("loaderd_workers_busy", "Pool workers with a task queued or running", value=sum(w.busy > 0 for w in workers))
        yield GaugeMetricFamily("loaderd_sessions", "Open shared-memory sessions", value=status.sessions)
        yield GaugeMetricFamily(
            "loaderd_sessions_paused", "Same-host sessions whose calls ended while their processes live (leases kept)", value=status.paused_sessions
        )
        yield GaugeMetricFamily("loaderd_uptime_seconds", "Seconds since the daemon started", value=status.uptime_s)


class BatchLatency:
    """The batch-latency histogram, in the daemon's ``registry``: the scheduler calls ``observe`` as batches finish."""

    def __init__(self, datasets: Iterable[str]) -> None:
        # Our own registry, not prometheus_client's global one: two daemons in a process never mix.
        self.registry = CollectorRegistry()
        self._latency = Histogram(
            "loaderd_batch_latency_seconds",
            "Seconds from handing a batch to a worker to its result",
            ["dataset"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        # Children made up front: the observer runs under the scheduler's lock, so it only observes.
        self._children = {name: self._latency.labels(name) for name in datasets}

    def observe(self, dataset: str, seconds: float) -> None:
        child = self._children.get(dataset)
        (child if child is not None else self._latency.labels(dataset)).observe(seconds)


def _bearer_only(app: Any, authenticator: Authenticator) -> Any:
    """``app`` answering 401 unless the scrape sends ``Authorization: Bearer <token>`` of the token file."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if authenticator.check_token([("authorization", environ.get("HTTP_AUTHORIZATION", ""))]):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"a bearer token is required\n"]
        return app(environ, start_response)

    return guarded


class _QuietHandler(WSGIRequestHandler):
    timeout = 10.0  # a scraper that stops mid-request does not hold its thread

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (prometheus_client's own server does the same)."""


class _Server(ThreadingWSGIServer):
    """prometheus_client's threading server, for either address family."""

    def __init__(self, address: tuple[str, int], handler: Any) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)


class MetricsEndpoint:
    """Serves ``registry`` (plus the status-derived families) over HTTP after ``serve``.

    With an ``authenticator``, every scrape needs a bearer token of its token file (``metrics.require_token``).
    """

    def __init__(self, registry: CollectorRegistry, snapshot: Callable[[], pb.StatusResponse], authenticator: Authenticator | None = None) -> None:
        self.registry = registry
        self.registry.register(_StatusCollector(snapshot))
        self._auth = authenticator
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def serve(self, host: str, port: int) -> str:
        """Start the HTTP endpoint (port 0 picks one); returns its URL. Raises OSError if it cannot bind."""
        if self._auth is None:
            self._server, self._thread = start_http_server(port, host, registry=self.registry)
        else:
            app = _bearer_only(make_wsgi_app(self.registry), self._auth)
            server = make_server(host, port, app, _Server, handler_class=_QuietHandler)
            self._server = server
            self._thread = threading.Thread(target=server.serve_forever, name="loaderd-metrics", daemon=True)
            self._thread.start()
        bound = self._server.server_address[1]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{bound}/metrics"

    def shutdown(self) -> None:
        """Stop serving and join the HTTP thread. Idempotent."""
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is None:
            return
        # No timeout needed: serve_forever checks for shutdown every 0.5 s, and its thread
        # was started by start_http_server.
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(_STOP_TIMEOUT_S)
