"""The daemon's config as it runs: frozen dataclasses, and ``load_config`` to read one from a YAML file.

The file's schema (keys, types, defaults, error words) is declared in document.py, with
pydantic; this module imports neither pydantic nor yaml until a file is parsed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from loaderd.wire.addresses import DEFAULT_ADDRESS, is_loopback

DEFAULT_LISTEN = (DEFAULT_ADDRESS,)


class ConfigError(Exception):
    """The config cannot be used; the message says where and why."""


@dataclass(frozen=True)
class CacheSpec:
    """A dataset's ``cache:``: where its items are kept once computed (server/cache/), and how much of them."""

    # "memory": shared memory the daemon owns (one copy per host, gone when the daemon stops);
    # "disk": a directory that outlives daemons and is shared by those on the host.
    tier: str
    max_bytes: int  # the most the items (and the store's own pages) take; then nothing more is added
    path: Path | None = None  # the disk tier's directory
    version: str = ""  # the user's own part of the items' fingerprint: change it when the dataset's code changes
    # Decide from the first items whether caching pays and fits (server/cache/auto.py); False: always cache.
    auto: bool = False


@dataclass(frozen=True)
class DatasetSpec:
    """One entry of ``datasets:``: how to build a dataset and what runs beside it."""

    name: str
    factory: str  # "module:attr", a Dataset class or a callable returning one
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    collate_fn: str | None = None
    worker_init_fn: str | None = None
    # Seconds one batch may run in a worker before the worker is killed and replaced
    # and the client gets a BatchTimeoutError for that batch (None: no limit).
    task_timeout: float | None = None
    # "per_worker": every worker builds its own copy. "once": built in the pool's fork
    # server before it forks the workers, which share its pages (server/worker/prebuilt.py).
    build: str = "per_worker"
    # "module:function" called on each item after it is fetched (or read from the cache), before collation.
    transform: str | None = None
    cache: CacheSpec | None = None  # None: every item computed every time
    # Threads in each worker that fetch and transform one batch's items side by side (server/worker/item_threads.py);
    # 1: one item after another, as torch's workers; "auto": each worker sizes it from the items/s it measures
    # (server/worker/thread_sizer.py).
    threads: int | Literal["auto"] = 1

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules of the callables it names (factory, collate_fn, worker_init_fn, transform)."""
        named = (self.factory, self.collate_fn, self.worker_init_fn, self.transform)
        return tuple(dict.fromkeys(value.partition(":")[0] for value in named if value))


@dataclass(frozen=True)
class MetricsConfig:
    """``metrics:``: where the Prometheus endpoint listens."""

    port: int = 9464  # 0 picks a free port; the log says which
    # Loopback by default: the endpoint names clients and datasets, so exposing it is a choice.
    host: str = "127.0.0.1"
    # With ``auth:``, scrapers must send ``Authorization: Bearer <token>`` (a token of the token file).
    require_token: bool = False


@dataclass(frozen=True)
class TlsSpec:
    """A listener's ``tls:``: absolute paths; with ``client_ca``, clients need a certificate it signed (mTLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None


@dataclass(frozen=True)
class ListenSpec:
    """One ``listen:`` entry: an address string, or a mapping that adds TLS and socket permissions.

    Plaintext TCP on an address that is not loopback is refused unless ``insecure``
    (``check_listen``). Unix sockets are created ``socket_mode`` (0600 unless set),
    group ``socket_group`` if set.
    """

    address: str
    tls: TlsSpec | None = None
    insecure: bool = False
    socket_mode: int | None = None
    socket_group: str | int | None = None  # a group name or a gid

    @property
    def unix(self) -> bool:
        return self.address.startswith("unix:")


@dataclass(frozen=True)
class AuthConfig:
    """``auth:``: bearer tokens, one ``name:token`` per line of ``token_file`` (see server/security/auth.py)."""

    token_file: Path


@dataclass(frozen=True)
class Limits:
    """``limits:``: what clients may ask of the daemon. Over a limit: RESOURCE_EXHAUSTED naming it.

    "Per client" means per client process (its session) and per connection. One host
    may hold all but an eighth of each total (server/rpc/admission.py).
    """

    max_streams: int = 1024  # open streams in total
    max_streams_per_client: int = 256
    max_sessions: int = 1024  # client processes connected at once
    max_watches: int = 64  # health Watch calls open at once
    # Batches a stream may plan beyond what its client consumed (a loader plans its window ahead).
    max_plan_ahead: int = 4096
    # Indices a stream may have planned but not yet dispatched (bounds the daemon's memory per stream).
    max_plan_indices: int = 1 << 22
    max_replicas: int = 256  # an iterable stream's num_workers
    max_name_bytes: int = 1024  # dataset, client and share names, share fingerprints
    max_request_bytes: int = 16 << 20  # one request message
    # Seconds a new Session or StreamBatches call has to send its first message.
    handshake_timeout: float = 10.0
    # The daemon pings each client connection this often (seconds) and closes one that has not
    # answered within keepalive_timeout: a vanished client's calls end within their sum.
    keepalive_time: float = 10.0
    keepalive_timeout: float = 10.0


@dataclass(frozen=True)
class LoaderConfig:
    """The whole config, with paths already made absolute."""

    path: Path
    listen: tuple[ListenSpec, ...]
    workers: int  # the pool's slots: its fixed size, or an elastic pool's most workers
    python_path: tuple[str, ...]
    datasets: dict[str, DatasetSpec]
    # Largest payload slice per gRPC message: gRPC Python is fastest with 1-8 MiB messages.
    chunk_bytes: int = 4 << 20
    # Server-side cap on a stream's prefetch window, in batches.
    max_window: int = 64
    # Batches a shared job keeps for consumers that join late or read slower (see server/scheduling/share.py).
    share_buffer: int = 32
    # Shared memory each worker may fill with batches waiting to be sent; 0 sends payloads over pipes.
    shm_bytes_per_worker: int = 1 << 30
    log_level: str = "INFO"
    log_format: str = "text"  # or "json": one object per line (server/process/log_format.py)
    metrics: MetricsConfig | None = None  # None: no metrics endpoint
    limits: Limits = field(default_factory=Limits)
    # Recycling (0: off): a worker is replaced, between batches, after this many
    # batches or once its resident memory exceeds this many MiB (leaky datasets).
    max_tasks_per_worker: int = 0
    worker_max_rss_mb: int = 0
    # SIGTERM drains: at most this many seconds for clients to move their streams elsewhere (0: stop at once).
    drain_timeout: float = 30.0
    auth: AuthConfig | None = None  # None: no tokens asked for
    # An elastic pool's fewest workers (it starts with these); None: a fixed pool of ``workers``.
    min_workers: int | None = None

    @property
    def modules(self) -> list[str]:
        """Every module its datasets name, sorted: what the fork server imports once for all workers."""
        return sorted({module for spec in self.datasets.values() for module in spec.modules})

    @property
    def first_workers(self) -> int:
        """The workers the pool starts with: all of a fixed pool's, an elastic pool's fewest."""
        return self.workers if self.min_workers is None else self.min_workers

    @property
    def workers_words(self) -> str:
        """The pool's size in words: "4", or "1 to 8 (elastic)"."""
        return str(self.workers) if self.min_workers is None else f"{self.min_workers} to {self.workers} (elastic)"

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(spec.address for spec in self.listen)


def check_port(value: Any, where: str) -> int:
    """A TCP port number (0: any free port), or ConfigError naming ``where`` (``--metrics-port``)."""
    from loaderd.server.config.document import check_port as check  # pydantic: the daemon's, never a worker's

    return check(value, where)


def check_listen(listen: tuple[ListenSpec, ...]) -> None:
    """Refuse plaintext TCP on an address that is not loopback, unless the entry says ``insecure: true``."""
    for spec in listen:
        if not spec.unix and spec.tls is None and not spec.insecure and not is_loopback(spec.address):
            raise ConfigError(
                f"listen: {spec.address} would serve plaintext beyond this host; add tls: {{cert, key}} to the entry, "
                "or insecure: true if the network is trusted"
            )


def parse_config(raw: Any, path: Path) -> LoaderConfig:
    """Validate a parsed YAML document against the schema (document.py); no dataset code is imported."""
    # Imported here: the pool's fork server and workers import this module for the config's classes and
    # never parse a file (pydantic costs ~100 ms and several MB at import).
    from loaderd.server.config.document import parse_document

    return parse_document(raw, path)


def load_config(path: str | Path) -> LoaderConfig:
    """Read and validate a config file."""
    path = Path(path).resolve()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from None
    # Imported here: the pool's fork server and workers import this module for the config's
    # classes and never parse a file (yaml would cost each pool ~0.7 MB and ~30 ms at start).
    import yaml

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    return parse_config(raw, path)
