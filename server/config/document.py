"""The config file's schema, declared as pydantic models: what each key accepts, its default and its words.

``parse_document`` validates a parsed YAML document against ``ConfigFile`` and turns it
into the daemon's ``LoaderConfig`` (schema.py's frozen dataclasses, which the pool's
processes use without pydantic). ``json_schema_text`` is the same schema for editors
(deploy/loaderd-config.schema.json). Errors read as messages.py words them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from loaderd.server.config.messages import config_error, expected, fail, says
from loaderd.server.config.schema import (
    DEFAULT_LISTEN,
    AuthConfig,
    CacheSpec,
    DatasetSpec,
    Limits,
    ListenSpec,
    LoaderConfig,
    MetricsConfig,
    TlsSpec,
    check_listen,
)
from loaderd.server.config.values import (
    AtLeast0,
    AtLeast1,
    Build,
    Bytes,
    ChunkBytes,
    Flag,
    Host,
    ImportPath,
    KeepaliveSeconds,
    LogFormatName,
    LogLevel,
    OptionalImportPath,
    PathText,
    Port,
    Seconds,
    SecondsOrZero,
    Section,
    Threads,
)
from loaderd.server.process.host_cpu import usable_cpus
from loaderd.server.process.host_memory import available_bytes, free_bytes
from loaderd.wire.limits import SHM_DIR

SCHEMA_FILE = "loaderd-config.schema.json"  # in deploy/
class TlsSection(Section):
    """A listener's TLS: PEM files, relative to this file (the daemon re-reads them when they change)."""

    cert: PathText = Field(description="The server's certificate chain.")
    key: PathText = Field(description="Its private key.")
    client_ca: PathText | None = Field(None, description="With it, clients must present a certificate this CA signed (mTLS).")


class ListenEntry(Section):
    """A listen entry as a mapping: an address with TLS, or a unix socket's permissions."""

    address: Annotated[str, says("an address string")] = Field(description="unix:///path/to.sock, host:port or [v6]:port.")
    tls: Annotated[TlsSection | None, says("a mapping with 'cert', 'key' and optionally 'client_ca'")] = Field(
        None, description="TCP only: serve TLS with these files."
    )
    insecure: Flag = Field(False, description="TCP only: allow plaintext beyond loopback (a trusted network).")
    # Unbounded in the schema: editors read `0660` as YAML 1.2's decimal 660, loaderd as YAML 1.1's octal.
    socket_mode: Annotated[int | None, says("an octal mode such as 0660")] = Field(
        None, description="Unix sockets only: the socket file's mode, in octal (default 0600); nothing for 'other'."
    )
    socket_group: Annotated[str | int | None, says("a group name or id")] = Field(None, description="Unix sockets only: the socket file's group.")

    @model_validator(mode="after")
    def _fits_the_address(self) -> ListenEntry:
        unix = self.address.startswith("unix:")
        if unix and self.tls is not None:
            fail(f"{self.address} is a unix socket, protected by its file mode (socket_mode/socket_group), not TLS", "tls")
        if not unix and (self.socket_mode is not None or self.socket_group is not None):
            fail(f"socket_mode and socket_group apply to unix sockets, not {self.address}")
        if self.tls is not None and self.insecure:
            fail("'tls' and 'insecure: true' contradict each other")
        mode = self.socket_mode
        if mode is not None and (not 0 <= mode <= 0o777 or mode & 0o007):
            fail(f"{mode:#o} must give 'other' users nothing (at most 0770)", "socket_mode", value=mode)
        return self


def _address_is_an_entry(value: Any) -> Any:
    return {"address": value} if isinstance(value, str) else value


def _address_is_a_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


Listener = Annotated[
    ListenEntry,
    BeforeValidator(_address_is_an_entry, json_schema_input_type=str | ListenEntry),
    says("an address string or a mapping with 'address'"),
]
Listen = Annotated[
    list[Listener],
    Field(min_length=1),
    BeforeValidator(_address_is_a_list, json_schema_input_type=str | Annotated[list[Listener], Field(min_length=1)]),
    says("an address or a list of addresses", too_short="needs at least one address"),
]


class CacheSection(Section):
    """Where a map-style dataset's items are kept once computed: read back instead of computed again."""

    memory: Bytes | None = Field(None, description="Shared memory the daemon owns, at most this size: one copy per host, gone when it stops.")
    disk: PathText | None = Field(None, description="A directory (relative to this file) that outlives the daemon and is shared by daemons.")
    max: Bytes | None = Field(None, description="With disk: the most the items there may take.")
    version: Annotated[str | int | None, says("a string")] = Field(
        None, description="Part of the items' key with the dataset's import path and arguments: change it when its code changes."
    )
    auto: bool = Field(
        False, description="Cache only if the first items show that it pays (reading one back costs at most half of computing it) and fits."
    )

    @model_validator(mode="after")
    def _one_tier(self) -> CacheSection:
        if (self.memory is None) == (self.disk is None):
            fail("needs either 'memory: BYTES' or 'disk: PATH' (with 'max: BYTES')")
        if self.disk is not None and self.max is None:
            fail("needs 'max: BYTES' with 'disk' (the most the items there may take)")
        if self.memory is not None and self.max is not None:
            fail("'max' goes with 'disk'; the memory tier's size is 'memory' itself", "max", value=self.max)
        return self


# ``cache: auto``'s memory tier: this share of the memory available when the config is read (host or cgroup),
# and at most this share of /dev/shm's free room (a container's may be 64 MiB): the batches travel there too.
# Several ``cache: auto`` datasets split both.
AUTO_MEMORY_SHARE = 0.25
AUTO_SHM_SHARE = 0.5
AUTO_MEMORY_FLOOR = 16 << 20  # where the memory available is unknown, or less would not be worth measuring


def auto_memory_bytes(datasets: int = 1) -> int:
    """The bound each of ``datasets`` datasets with ``cache: auto`` gives its memory tier on this host, now."""
    room = available_bytes()
    size = max(AUTO_MEMORY_FLOOR, int(room * AUTO_MEMORY_SHARE)) if room is not None else AUTO_MEMORY_FLOOR
    shm = free_bytes(SHM_DIR)
    if shm is not None:
        size = min(size, int(shm * AUTO_SHM_SHARE))
    return max(1 << 20, size // max(1, datasets))  # the memory tier's least size (1 MiB): auto then finds it too small


def _auto_or_a_mapping(value: Any) -> Any:
    if value is not None and value != "auto" and not isinstance(value, dict | CacheSection):
        fail("expected 'auto', or a mapping with 'memory', or 'disk' and 'max'", value=value)
    return value


Cache = Annotated[
    CacheSection | Literal["auto"] | None,
    BeforeValidator(_auto_or_a_mapping, json_schema_input_type=CacheSection | Literal["auto"] | None),
    says("'auto', or a mapping with 'memory', or 'disk' and 'max'"),
]


class DatasetEntry(Section):
    """One dataset: the callable that builds it, its arguments, and what runs beside it."""

    dataset: ImportPath = Field(description="A Dataset class, or a callable that returns a dataset.")
    args: Annotated[list[Any] | None, says("a list")] = Field(None, description="Positional arguments for it.")
    kwargs: Annotated[dict[Any, Any] | None, says("a mapping")] = Field(None, description="Keyword arguments for it.")
    collate_fn: OptionalImportPath = Field(None, description="The collate function (default: torch's default_collate).")
    worker_init_fn: OptionalImportPath = Field(None, description="Called in each worker with its id.")
    task_timeout: Seconds | None = Field(None, description="Seconds one batch may run before its worker is replaced (BatchTimeoutError).")
    build: Build = Field("per_worker", description="per_worker: each worker builds its own; once: built once, shared by every worker.")
    transform: OptionalImportPath = Field(
        None, description="Called on each item after it is fetched (or read from the cache), before collation, under the batch's seeds."
    )
    cache: Cache = Field(
        None,
        description="Map-style datasets: keep items once computed, in memory or on disk; auto: in memory (a quarter of what is "
        "available, half of /dev/shm's room at most) where the first items show that it pays.",
    )
    threads: Threads = Field(
        1,
        description="Threads in each worker that fetch and transform a batch's items side by side: for items whose heavy "
        "calls release the GIL (image decoding, torch ops, reads); random draws then interleave between threads. auto: each "
        "worker starts at 1 and doubles them while that raises its items/s (items that wait on storage).",
    )


class WorkersSection(Section):
    """An elastic pool: it grows while trainers wait for data and shrinks while workers idle (server/scheduling/sizing.py)."""

    min: AtLeast1 = Field(1, description="The fewest workers, kept warm while no trainer asks (default 1).")
    max: AtLeast1 | None = Field(
        None,
        description="The most workers (default: 4 per CPU this process may use, from its affinity and cgroup quota; "
        "past the CPUs only while CPU sits idle).",
    )

    @model_validator(mode="after")
    def _min_within_max(self) -> WorkersSection:
        if self.max is not None and self.min > self.max:
            fail(f"{self.min} is more than max ({self.max})", "min", value=self.min)
        return self


def _a_count_auto_or_a_mapping(value: Any) -> Any:
    """``workers: N`` is ``{min: N, max: N}`` (a fixed pool), ``auto`` is ``{}`` (1 to the CPUs this process may use)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            fail(f"must be at least 1, got {value}")
        return {"min": value, "max": value}
    if value == "auto":
        return {}
    if not isinstance(value, dict | WorkersSection):
        fail(expected("an integer, 'auto', or a mapping with 'min' and/or 'max'", value))
    return value


Workers = Annotated[
    WorkersSection,
    BeforeValidator(
        _a_count_auto_or_a_mapping, json_schema_input_type=Annotated[int, Field(ge=1)] | Literal["auto"] | WorkersSection
    ),
]


# ``workers: auto``'s most workers, per CPU this process may use: an I/O-bound dataset (network storage, object
# stores) wants several times more workers than cores; a CPU-bound one stops growing at its cores all the same,
# since the pool grows past them only while CPU sits idle (server/scheduling/sizing.py).
AUTO_WORKERS_PER_CPU = 4


def worker_bounds(workers: WorkersSection) -> tuple[int, int | None]:
    """(most workers, fewest or None for a fixed pool) for the config's ``workers``, on this host now."""
    most = workers.max if workers.max is not None else max(workers.min, AUTO_WORKERS_PER_CPU * usable_cpus())
    return most, workers.min if workers.min < most else None


def _some_dataset(value: Any) -> Any:
    if not value:  # absent, `datasets:`, {} or []: before its type, the real problem
        fail("the config defines no dataset")
    return value


Datasets = Annotated[
    dict[Annotated[str, says("a string name")], Annotated[DatasetEntry, says("a mapping with at least 'dataset'")]],
    Field(min_length=1),
    BeforeValidator(_some_dataset),
    says("a mapping of name to dataset"),
]


class MetricsSection(Section):
    """The Prometheus endpoint."""

    port: Port = Field(MetricsConfig.port, description="0: any free port (the log says which).")
    host: Host = Field(MetricsConfig.host, description="Loopback by default: the endpoint names clients and datasets.")
    require_token: Flag = Field(MetricsConfig.require_token, description="Scrapers must send a token of auth.token_file.")


class AuthSection(Section):
    """Bearer tokens: every call but health checks needs one, on every listener."""

    token_file: PathText = Field(description="Lines name:token; other users must not be able to read it.")


class LimitsSection(Section):
    """What clients may ask of the daemon; over a limit, RESOURCE_EXHAUSTED naming it."""

    max_streams: AtLeast1 = Field(Limits.max_streams, description="Open streams in all.")
    max_streams_per_client: AtLeast1 = Field(Limits.max_streams_per_client, description="Per client process (its session) and per connection.")
    max_sessions: AtLeast1 = Field(Limits.max_sessions, description="Client processes connected at once.")
    max_watches: AtLeast1 = Field(Limits.max_watches, description="Health Watch calls open at once.")
    max_plan_ahead: AtLeast1 = Field(Limits.max_plan_ahead, description="Batches a stream may plan beyond what its client consumed.")
    max_plan_indices: AtLeast1 = Field(Limits.max_plan_indices, description="Indices a stream may have planned and not yet dispatched.")
    max_replicas: AtLeast1 = Field(Limits.max_replicas, description="An iterable stream's num_workers.")
    max_name_bytes: AtLeast1 = Field(Limits.max_name_bytes, description="Dataset, client and share names, share fingerprints.")
    max_request_bytes: AtLeast1 = Field(Limits.max_request_bytes, description="One request message.")
    handshake_timeout: Seconds = Field(Limits.handshake_timeout, description="Seconds a new call has to send its first message.")
    keepalive_time: KeepaliveSeconds = Field(Limits.keepalive_time, description="Seconds between the daemon's pings of each client connection.")
    keepalive_timeout: KeepaliveSeconds = Field(
        Limits.keepalive_timeout, description="Seconds a client has to answer a ping before its connection, and its calls, are closed."
    )


def _null_is_empty(value: Any) -> Any:
    return {} if value is None else value  # `metrics:` (YAML null): the section with every default


# None stands only for an absent `metrics:` (no endpoint); an empty one turns it on.
Metrics = Annotated[
    MetricsSection | None,
    BeforeValidator(_null_is_empty, json_schema_input_type=MetricsSection | None),
    says("a mapping with 'port', 'host' and/or 'require_token'"),
]
LimitsOrDefaults = Annotated[LimitsSection, BeforeValidator(_null_is_empty, json_schema_input_type=LimitsSection | None), says("a mapping")]


class ConfigFile(Section):
    """loaderd's config (loaderd serve --config FILE)."""

    model_config = ConfigDict(title="loaderd config")

    # pydantic reports errors key by key in this order, then the cross-checks; ConfigError says the first. A config
    # with one mistake reads as the hand-written parser said it; of several mistakes, the first in this order is named.
    listen: Listen = Field(
        list(DEFAULT_LISTEN),
        validate_default=True,  # the default's strings become entries too
        description="One or more addresses, each served; plaintext TCP beyond loopback needs tls (or insecure: true).",
    )
    python_path: Annotated[list[Annotated[str, says("a directory")]], says("a list of directories")] = Field(
        [], description="Prepended to sys.path in the daemon and its workers (relative to this file)."
    )
    datasets: Datasets = Field(description="The datasets clients may ask for, by name.")
    log_level: LogLevel = Field("INFO", description="DEBUG, INFO, WARNING or ERROR (any case).")
    log_format: LogFormatName = Field("text", description="text, or json: one object per line (daemon and workers).")
    auth: Annotated[AuthSection | None, says("a mapping with 'token_file'")] = Field(None, description="Absent: no token asked for.")
    metrics: Metrics = Field(None, description="Absent: no endpoint; empty: on, with the defaults.")
    workers: Workers = Field(
        2,
        validate_default=True,  # the default's 2 becomes {min: 2, max: 2} too
        description="The shared worker pool: a fixed size; auto (from 1 to 4 per CPU this process may use: the same as {}); "
        "or {min, max}, grown while tasks wait for a busy pool and CPU (or I/O) has room, shrunk while workers idle.",
    )
    chunk_bytes: ChunkBytes = Field(LoaderConfig.chunk_bytes, description="Payload bytes per gRPC message (gRPC Python is fastest at 1-8 MiB).")
    max_window: AtLeast1 = Field(LoaderConfig.max_window, description="Cap on any stream's prefetch window, in batches.")
    share_buffer: AtLeast0 = Field(LoaderConfig.share_buffer, description="Batches a shared job keeps for late joiners and slower readers.")
    shm_bytes_per_worker: AtLeast0 = Field(LoaderConfig.shm_bytes_per_worker, description="Shared memory for a worker's batches (0: pipes).")
    limits: LimitsOrDefaults = Field({}, validate_default=True, description="What clients may ask of the daemon.")
    max_tasks_per_worker: AtLeast0 = Field(LoaderConfig.max_tasks_per_worker, description="Replace a worker after this many batches (0: never).")
    worker_max_rss_mb: AtLeast0 = Field(LoaderConfig.worker_max_rss_mb, description="Replace a worker past this resident MiB (0: never).")
    drain_timeout: SecondsOrZero = Field(LoaderConfig.drain_timeout, description="SIGTERM: seconds clients get to move elsewhere (0: stop at once).")

    @model_validator(mode="before")
    @classmethod
    def _a_mapping(cls, data: Any) -> Any:
        if data is None:
            data = {}  # an empty file: it says what it lacks, its datasets
        if not isinstance(data, dict):
            fail(expected("a mapping at the top level", data), value=data)
        return {"datasets": None, **data}  # absent: the datasets' own check says so, not "missing required key"

    @model_validator(mode="after")
    def _tokens_for_metrics(self) -> ConfigFile:
        if self.metrics is not None and self.metrics.require_token and self.auth is None:
            fail("needs auth.token_file (the tokens scrapers must send)", "metrics", "require_token", value=True)
        return self


# ------------------------------------------------------------------ to the daemon's config


def _cache(section: CacheSection | Literal["auto"] | None, file: Any, auto_bytes: int) -> CacheSpec | None:
    if section is None:
        return None
    if section == "auto":
        return CacheSpec(tier="memory", max_bytes=auto_bytes, auto=True)
    version = "" if section.version is None else str(section.version)
    if section.memory is not None:
        return CacheSpec(tier="memory", max_bytes=section.memory, version=version, auto=section.auto)
    assert section.disk is not None and section.max is not None  # _one_tier
    return CacheSpec(tier="disk", max_bytes=section.max, path=file(section.disk), version=version, auto=section.auto)


def _config(doc: ConfigFile, path: Path) -> LoaderConfig:
    """The validated document as the daemon's runtime config, its paths resolved against the config's directory."""

    def file(name: str) -> Path:
        return (path.parent / name).resolve()

    def tls(section: TlsSection) -> TlsSpec:
        return TlsSpec(file(section.cert), file(section.key), file(section.client_ca) if section.client_ca is not None else None)

    listen = tuple(ListenSpec(e.address, tls(e.tls) if e.tls else None, e.insecure, e.socket_mode, e.socket_group) for e in doc.listen)
    check_listen(listen)  # a policy on the runtime specs, which `serve --listen` overrides get too
    autos = sum(entry.cache == "auto" for entry in doc.datasets.values())
    auto_bytes = auto_memory_bytes(autos) if autos else 0
    datasets = {
        name: DatasetSpec(
            name=name,
            factory=entry.dataset,
            args=tuple(entry.args or ()),
            kwargs=dict(entry.kwargs or {}),
            collate_fn=entry.collate_fn,
            worker_init_fn=entry.worker_init_fn,
            task_timeout=entry.task_timeout,
            build=entry.build,
            transform=entry.transform,
            cache=_cache(entry.cache, file, auto_bytes),
            threads=entry.threads,
        )
        for name, entry in doc.datasets.items()
    }
    most, fewest = worker_bounds(doc.workers)
    scalars = {"chunk_bytes", "max_window", "share_buffer", "shm_bytes_per_worker", "log_level", "log_format"}
    scalars |= {"max_tasks_per_worker", "worker_max_rss_mb", "drain_timeout"}
    return LoaderConfig(
        path=path,
        listen=listen,
        python_path=tuple(str(file(p)) for p in doc.python_path),
        datasets=datasets,
        metrics=MetricsConfig(**doc.metrics.model_dump()) if doc.metrics is not None else None,
        limits=Limits(**doc.limits.model_dump()),
        auth=AuthConfig(file(doc.auth.token_file)) if doc.auth is not None else None,
        workers=most,
        min_workers=fewest,
        **doc.model_dump(include=scalars),
    )


def parse_document(raw: Any, path: Path) -> LoaderConfig:
    """A parsed YAML document, validated; ConfigError naming the first thing wrong."""
    try:
        doc = ConfigFile.model_validate(raw)
    except ValidationError as exc:
        raise config_error(exc, path) from None
    return _config(doc, path)


def check_port(value: Any, where: str) -> int:
    """A TCP port number (0: any free port), or ConfigError naming ``where``."""
    try:
        port: int = TypeAdapter(Port).validate_python(value, strict=True)
    except ValidationError as exc:
        raise config_error(exc, where) from None
    return port


def json_schema_text() -> str:
    """The config's JSON Schema, as committed in deploy/ (editors: yaml-language-server's ``$schema``)."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **ConfigFile.model_json_schema()}
    return json.dumps(schema, indent=2) + "\n"
