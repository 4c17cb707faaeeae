"""Daemon: starts the pool, then the gRPC server; one shutdown protocol for both.

Startup order matters: the worker pool (and its fork server) exists before any
gRPC server, so no process is ever forked from one running gRPC threads.

Drain (``Daemon.drain``, run on SIGTERM before shutdown; see server/rpc/drain.py):
health -> NOT_SERVING, new streams refused UNAVAILABLE, every open stream told
``Draining`` so its client moves elsewhere; it returns once no stream is open,
the config's ``drain_timeout`` has passed, or ``abort`` is set (SIGINT, a
second SIGTERM).

Shutdown (``Daemon.shutdown``, idempotent, run after the drain, or at once on SIGINT):
  1. health -> NOT_SERVING, so load balancers and tools stop sending clients;
  2. the scheduler fails every stream with UNAVAILABLE and stops its thread;
  3. client sessions close, giving back every slot clients held, and their
     calls end (a session's call lasts as long as its client process, so
     it would otherwise hold the next step for its whole grace period);
  4. the gRPC server stops (grace period for in-flight replies); the direct
     socket (server/rpc/direct_listener.py) stops accepting, its thread is
     joined and its file removed; then the watchdog that cuts silent calls;
  5. the metrics HTTP server (if any) stops and its thread is joined;
  6. workers get a stop message, then terminate/kill after a timeout, and the
     fork server is stopped and reaped;
  7. the slot ledger unlinks every shared-memory segment of this daemon, then
     the daemon its memory-tier item caches (and their lock files);
  8. unix socket files are removed.
A daemon that cannot serve any more (its scheduler keeps failing, no worker
can start) says NOT_SERVING at once and sets ``failed``; ``loaderd serve``
then runs this protocol and exits non-zero so a supervisor restarts it.
A daemon killed with SIGKILL cannot run this: its workers exit when they see
their parent gone, and the next daemon to start sweeps its segments.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from loaderd.server.cache.auto import AutoCache, AutoCaches
from loaderd.server.cache.location import locate
from loaderd.server.cache.usage import CacheLocation
from loaderd.server.config.schema import ConfigError, LoaderConfig
from loaderd.server.ops.status import StatusBoard
from loaderd.server.pool.fork_server import PoolStartError
from loaderd.server.pool.pool import WorkerPool
from loaderd.server.process.heap import give_back_free_pages, tune_heap
from loaderd.server.rpc.admission import Admission, handler_threads
from loaderd.server.rpc.direct_listener import DirectListener
from loaderd.server.rpc.drain import DrainSignal
from loaderd.server.rpc.executor import ElasticExecutor
from loaderd.server.rpc.handlers import SERVICE_NAME, add_parsing, generic_handler
from loaderd.server.rpc.health import AdmittedHealth
from loaderd.server.rpc.liveness import keepalive_options
from loaderd.server.rpc.servicer import LoaderServicer
from loaderd.server.rpc.sessions import SessionHost, SessionRegistry
from loaderd.server.rpc.watchdog import Watchdog
from loaderd.server.scheduling.catalog import Catalog
from loaderd.server.scheduling.ledger import SlotLedger
from loaderd.server.scheduling.pool_protocol import SchedulerPolicy
from loaderd.server.scheduling.scheduler import Scheduler
from loaderd.server.security.auth import Authenticator, TokenFile, TokenFileError, TokenInterceptor
from loaderd.server.security.listeners import (
    Listener,
    ListenError,
    bind,
    check_free,
    log_listening,
    prepare,
    secure_sockets,
    tcp_in_use,
)
from loaderd.server.shm.arena import daemon_prefix, shm_available, sweep_stale, unlink_segments
from loaderd.server.worker.import_check import ImportCheck
from loaderd.server.worker.tasks import DatasetMeta
from loaderd.wire.addresses import is_loopback
from loaderd.wire.direct_frames import DIRECT_SOCKET_SUFFIX
from loaderd.wire.limits import MAX_MESSAGE_BYTES, SHM_DIR

if TYPE_CHECKING:
    from loaderd.server.ops.metrics import BatchLatency, MetricsEndpoint

log = logging.getLogger("loaderd")

# How often an idle daemon gives the C heap's free pages back to the system.
MEMORY_TRIM_S = 30.0


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the limit now in force.

    Each client connection and each worker's pipes and queue take descriptors;
    systemd's default soft limit (1,024) is easily reached by a busy daemon.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft


def _direct_listener(names: str, handshake_timeout: float) -> DirectListener | None:
    """The direct socket beside the segments (server/rpc/direct_listener.py), accepting; None if it cannot be made
    (same-host calls' responses then stay on gRPC)."""
    try:
        listener = DirectListener(os.path.join(SHM_DIR, names + DIRECT_SOCKET_SUFFIX), handshake_timeout)
    except OSError as exc:
        log.warning("no direct socket (%s): same-host batches travel on gRPC", exc)
        return None
    listener.start()
    return listener


def _metrics_unavailable(host: str, port: int, reason: str) -> ListenError:
    return ListenError(f"cannot serve metrics on {host}:{port}: {reason}")


def _auto_caches(config: LoaderConfig, catalog: Catalog, locations: Mapping[str, CacheLocation]) -> AutoCaches:
    """The ``cache: auto`` datasets' policies (server/cache/auto.py); one that decides off takes its memory tier's file with it
    (the items stored while measuring; a worker started later makes an empty one, swept with the daemon's others)."""

    def drop(dataset: str) -> None:
        where = locations[dataset]
        if where.tier == "memory":
            for path in (where.path, f"{where.path}-lock"):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as exc:  # logged; the daemon's stop sweeps its segment prefix anyway
                    log.warning("dataset %r: cannot remove %s: %s", dataset, path, exc)

    return AutoCaches(
        {
            name: AutoCache(name, spec.cache.max_bytes, catalog.datasets[name].length)
            for name, spec in config.datasets.items()
            if spec.cache is not None and spec.cache.auto and name in locations and name in catalog.datasets
        },
        drop,
    )


@dataclass
class Daemon:
    config: LoaderConfig
    startup_timeout: float = 600.0
    bound: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False
        # Set by start(), in this order; shutdown() stops whatever was set.
        self.pool: WorkerPool | None = None
        self.ledger: SlotLedger | None = None
        self._cache_prefix: str | None = None  # the memory tier's item caches in /dev/shm (None: none)
        self.scheduler: Scheduler | None = None
        self.session_host: SessionHost | None = None
        self.direct: DirectListener | None = None
        self.server: grpc.Server | None = None
        self.metrics: MetricsEndpoint | None = None
        self.watchdog = Watchdog()
        self._executor: ElasticExecutor | None = None
        # Counts the long-lived calls (sessions, streams, health watches) of every client: server/rpc/admission.py.
        self.admission = Admission(self.config.limits)
        self.health = AdmittedHealth(self.admission)
        self.drain_signal = DrainSignal()
        self._listeners: list[Listener] = []
        self._unix_paths: list[str] = []
        # Set when the daemon cannot serve any more (the reason is in ``fatal``): the caller shuts down and exits non-zero.
        self.failed = threading.Event()
        self.fatal: str | None = None

    def start(self) -> None:
        """Import, start the warm pool, then serve. Raises ConfigError, PoolStartError, ListenError.

        Every part gets what it depends on at construction; this is the whole wiring.
        """
        config = self.config
        # The daemon itself imports no dataset (nor torch): a child forked now checks the config's imports
        # if the pool's start fails, to name the culprit (server/worker/import_check.py).
        check = ImportCheck(config, self.startup_timeout)
        try:
            # Credentials are checked before the pool starts: a bad file fails in a second, not after warm-up.
            self._listeners = prepare(config.listen)
            # An address another daemon serves fails now, not after the pool has built the datasets.
            check_free(self._listeners)
            if config.metrics is not None and tcp_in_use(config.metrics.host, config.metrics.port):
                raise _metrics_unavailable(config.metrics.host, config.metrics.port, os.strerror(errno.EADDRINUSE))
            try:
                authenticator = Authenticator(TokenFile(config.auth.token_file) if config.auth is not None else None)
            except TokenFileError as exc:
                raise ConfigError(str(exc)) from None
            fd_limit = raise_fd_limit()
            tune_heap()
            swept = sweep_stale()
            if swept:
                log.info("removed %d shared-memory segments left by a daemon that was killed", swept)
            names = daemon_prefix(os.getpid(), secrets.token_hex(8))
            shm_prefix = names if config.shm_bytes_per_worker > 0 and shm_available() else None
            # The memory tier's item caches (server/cache/item_store.py): this daemon's, removed when it stops.
            memory_cache = any(spec.cache is not None and spec.cache.tier == "memory" for spec in config.datasets.values())
            self._cache_prefix = f"{names}cache-" if memory_cache and shm_available() else None
            sessions = SessionRegistry()
            self.pool = pool = WorkerPool(config, shm_prefix, self._cache_prefix)
            self.ledger = ledger = SlotLedger(shm_prefix, give_back=pool.give_back, on_retired=sessions.announce_retired)
            catalog = Catalog(self._start_pool(pool, check), pool.size)
        finally:
            check.close()
        log.info(
            "pool of %s workers ready with datasets: %s",
            config.workers if config.min_workers is None else f"{config.min_workers} (elastic, up to {config.workers})",
            ", ".join(f"{n} ({'iterable' if m.iterable else f'{m.length} items'})" for n, m in catalog.datasets.items()),
        )
        latency: BatchLatency | None = None
        if config.metrics is not None:
            # Imported only here: prometheus_client and its HTTP server are ~3.5 MB of every daemon otherwise.
            from loaderd.server.ops.metrics import BatchLatency

            latency = BatchLatency(catalog.datasets)
        caches = {spec.name: where for spec in config.datasets.values() if (where := locate(spec, self._cache_prefix)) is not None}
        self.scheduler = scheduler = Scheduler(
            pool,
            ledger,
            catalog,
            SchedulerPolicy.from_config(config, start_timeout=self.startup_timeout),
            on_batch=latency.observe if latency is not None else None,
            on_fatal=self._on_fatal,
            caches=_auto_caches(config, catalog, caches),
        )
        scheduler.start()
        self.watchdog.start()
        self.watchdog.arm(MEMORY_TRIM_S, self._trim_memory)
        limits = config.limits
        self.direct = direct = _direct_listener(names, limits.handshake_timeout) if shm_prefix is not None else None
        self.session_host = session_host = SessionHost(sessions, ledger, shm_prefix, self.watchdog, limits.handshake_timeout, direct)
        status = StatusBoard(pool.states, catalog, scheduler, sessions, caches)
        if config.metrics is not None and latency is not None:
            from loaderd.server.ops.metrics import MetricsEndpoint

            scrape_auth = authenticator if config.metrics.require_token else None
            self.metrics = MetricsEndpoint(latency.registry, status.snapshot, scrape_auth)
            host, port = config.metrics.host, config.metrics.port
            try:
                url = self.metrics.serve(host, port)
            except OSError as exc:
                raise _metrics_unavailable(host, port, exc.strerror or str(exc)) from None
            log.info("metrics on %s", url)
            if not is_loopback(f"{host}:{port}") and not config.metrics.require_token:
                log.warning(
                    "metrics on %s answer anyone who can reach them (client and dataset names); "
                    "set metrics.require_token (with auth:) or keep metrics.host on loopback",
                    url,
                )
        servicer = LoaderServicer(
            config, catalog, scheduler, session_host, ledger, status.snapshot, self.watchdog, self.drain_signal, authenticator, self.admission
        )
        threads = handler_threads(limits)
        log.info("open-file limit %d; up to %d handler threads", fd_limit, threads)
        # Threads idle for 30 s exit: a burst of streams leaves none behind.
        self._executor = executor = ElasticExecutor(threads, idle_timeout=30.0, thread_name_prefix="loaderd-rpc")
        self.server = grpc.server(
            # Each open stream and each client session holds one thread for its
            # lifetime; admission (server/rpc/admission.py) keeps their number below
            # this, so short calls (health, Status) always find a thread.
            executor,
            handlers=[generic_handler(servicer, raw_responses={"StreamBatches"})],
            # Every call but health's Check needs a token when auth: is set (server/security/auth.py).
            interceptors=[TokenInterceptor(authenticator)] if authenticator.required else None,
            # A backstop to admission: past this many calls at once (health's Watch included),
            # new ones are refused RESOURCE_EXHAUSTED rather than queued behind busy threads.
            maximum_concurrent_rpcs=threads,
            options=[
                ("grpc.max_receive_message_length", limits.max_request_bytes),
                # A batch header carries up to MAX_HEADER_BYTES of structure plus a data chunk.
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                # Clients ping every 10 s to notice a frozen daemon (client/fleet/connection.py); allow it,
                # also on a connection whose only call (a session) carries no data.
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
                *keepalive_options(limits),
            ],
        )
        self._serve(self.server)

    def _serve(self, server: grpc.Server) -> None:
        """Add health and reflection, bind every listen address, start, and say SERVING."""
        add_parsing(health_pb2_grpc.add_HealthServicer_to_server, self.health, server)
        # Reflection lets grpcurl and friends list and call the services without the .proto files.
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        add_parsing(reflection_pb2_grpc.add_ServerReflectionServicer_to_server, reflection.ReflectionServicer(names), server)
        self.bound = bind(server, self._listeners, self._unix_paths)
        server.start()
        secure_sockets(self._listeners)
        log_listening(self._listeners, self.bound)  # before SERVING: tools read the bound port once healthy
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def _trim_memory(self) -> None:
        """Every MEMORY_TRIM_S on the watchdog's thread: while no stream is open, give free heap pages back."""
        scheduler = self.scheduler
        if scheduler is not None:
            if not scheduler.open_streams():
                give_back_free_pages()
        if not self.failed.is_set():
            self.watchdog.arm(MEMORY_TRIM_S, self._trim_memory)

    def _on_fatal(self, reason: str) -> None:
        """The daemon cannot serve any more: say so at once; ``loaderd serve`` shuts down and exits non-zero."""
        if self.failed.is_set():
            return
        self.fatal = reason
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.critical("cannot serve any more (%s); shutting down so a supervisor can restart the daemon", reason)
        self.failed.set()

    def _start_pool(self, pool: WorkerPool, check: ImportCheck) -> dict[str, DatasetMeta]:
        """``pool.start``; if it fails, the import check runs and a failed check wins, since its message names the
        module (the pool saw only its effect). A pool that started imported every module: no check runs."""
        try:
            return pool.start(self.startup_timeout)
        except PoolStartError:
            check.raise_problem()  # the imports' fault: say so
            raise

    def drain(self, timeout: float, abort: threading.Event) -> None:
        """The drain in the module docstring: returns when no stream is open, after ``timeout`` s, or on ``abort``."""
        scheduler = self.scheduler
        if scheduler is None or self.server is None:
            return
        self.drain_signal.begin(timeout)
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + timeout
        open_streams = scheduler.open_streams()
        log.info("draining: %d stream(s) open; stopping within %gs (drain_timeout)", open_streams, timeout)
        while open_streams and not abort.is_set() and not self.failed.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                log.info("drain timeout: %d stream(s) still open are cut", open_streams)
                return
            abort.wait(min(0.05, left))
            open_streams = scheduler.open_streams()
        if not open_streams:
            log.info("drained: no stream open")

    def shutdown(self, grace: float = 2.0) -> None:
        """The shutdown protocol in the module docstring. Safe to call twice or after a failed start."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        # A start that failed is reported by the caller in one line; stay quiet here.
        say = log.info if self.server is not None else log.debug
        say("shutting down")
        self.health.enter_graceful_shutdown()
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.session_host is not None:
            self.session_host.close_all()
        if self.server is not None:
            self.server.stop(grace).wait(grace + 1.0)
        if self._executor is not None:
            self._executor.shutdown(wait=False)  # its threads are daemon threads; the calls they ran have ended
        if self.direct is not None:
            self.direct.close()  # connections no call claimed; the calls' own go with their handlers
        self.watchdog.stop()
        if self.metrics is not None:
            self.metrics.shutdown()
        if self.pool is not None:
            self.pool.shutdown()
        if self.ledger is not None:
            self.ledger.close()
        if self._cache_prefix is not None:
            unlink_segments(self._cache_prefix)  # the memory tier's items: no worker maps them any more
        for path in self._unix_paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        say("stopped")
