"""The daemon's YAML config: parsed, validated, and every error naming its culprit."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loaderd.server.process.log_format import LOG_FORMATS
from loaderd.wire.addresses import DEFAULT_ADDRESS, is_loopback
from loaderd.wire.limits import MAX_CHUNK_BYTES

DEFAULT_LISTEN = (DEFAULT_ADDRESS,)


class ConfigError(Exception):
    """The config cannot be used; the message says where and why."""


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
    socket_group: str | None = None

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

    "Per client" means per client process (its session) or, for a client
    without one, per connection.
    """

    max_streams: int = 1024  # open streams in total
    max_streams_per_client: int = 256
    max_sessions: int = 1024  # client processes connected at once
    # Batches a stream may plan beyond what its client consumed (a loader plans its window ahead).
    max_plan_ahead: int = 4096
    # Indices a stream may have planned but not yet dispatched (bounds the daemon's memory per stream).
    max_plan_indices: int = 1 << 22
    max_replicas: int = 256  # an iterable stream's num_workers
    max_name_bytes: int = 1024  # dataset, client and share names, share fingerprints
    max_request_bytes: int = 16 << 20  # one request message
    # Seconds a new Session or StreamBatches call has to send its first message.
    handshake_timeout: float = 10.0


@dataclass(frozen=True)
class LoaderConfig:
    """The whole config, with paths already made absolute."""

    path: Path
    listen: tuple[ListenSpec, ...]
    workers: int
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

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(spec.address for spec in self.listen)


_TOP_KEYS = {
    "listen",
    "workers",
    "python_path",
    "datasets",
    "chunk_bytes",
    "max_window",
    "share_buffer",
    "shm_bytes_per_worker",
    "log_level",
    "log_format",
    "metrics",
    "limits",
    "max_tasks_per_worker",
    "worker_max_rss_mb",
    "drain_timeout",
    "auth",
}
_DATASET_KEYS = {"dataset", "args", "kwargs", "collate_fn", "worker_init_fn", "task_timeout", "build"}
_BUILD_MODES = ("per_worker", "once")
_METRICS_KEYS = {"port", "host", "require_token"}
_LISTEN_KEYS = {"address", "tls", "insecure", "socket_mode", "socket_group"}
_TLS_KEYS = {"cert", "key", "client_ca"}


def _expect(value: Any, kind: type | tuple[type, ...], where: str, what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {what}, got {type(value).__name__} {value!r}")
    return value


def _unknown_keys(got: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(got) - allowed, key=str)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"{where}: unknown key {key!r} ({hint}allowed: {', '.join(sorted(allowed))})")


def _import_path(value: Any, where: str) -> str:
    _expect(value, str, where, "an import path 'module:attribute'")
    module, sep, attr = value.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{where}: {value!r} is not of the form 'module:attribute'")
    return value


def _int_at_least(raw: dict[str, Any], key: str, default: int, minimum: int, where: str = "") -> int:
    value = _expect(raw.get(key, default), int, where + key, "an integer")
    if value < minimum:
        raise ConfigError(f"{where}{key}: must be at least {minimum}, got {value}")
    return value


def _chunk_bytes(raw: dict[str, Any]) -> int:
    value = _int_at_least(raw, "chunk_bytes", 4 << 20, 1)
    if value > MAX_CHUNK_BYTES:
        raise ConfigError(f"chunk_bytes: at most {MAX_CHUNK_BYTES} (16 MiB), got {value}")
    return value


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
        raise ConfigError(f"{where}: expected a positive number of seconds, got {value!r}")
    return float(value)


def _limits(raw: Any) -> Limits:
    raw = {} if raw is None else raw
    _expect(raw, dict, "limits", "a mapping")
    default = Limits()
    _unknown_keys(raw, set(default.__dataclass_fields__), "limits")
    values: dict[str, Any] = {}
    for key in default.__dataclass_fields__:
        if key == "handshake_timeout":
            values[key] = _seconds(raw.get(key, default.handshake_timeout), "limits.handshake_timeout")
        else:
            values[key] = _int_at_least(raw, key, getattr(default, key), 1, "limits.")
    return Limits(**values)


def check_port(value: Any, where: str) -> int:
    """A TCP port number (0: any free port), or ConfigError naming ``where``."""
    _expect(value, int, where, "a port number")
    if not 0 <= value <= 65535:
        raise ConfigError(f"{where}: must be a port number from 0 to 65535, got {value}")
    return value


def _metrics(raw: Any) -> MetricsConfig:
    # An empty `metrics:` (YAML null) turns the endpoint on with the defaults.
    raw = {} if raw is None else raw
    _expect(raw, dict, "metrics", "a mapping with 'port', 'host' and/or 'require_token'")
    _unknown_keys(raw, _METRICS_KEYS, "metrics")
    default = MetricsConfig()
    host = _expect(raw.get("host", default.host), str, "metrics.host", "a host name or IP address")
    if not host.strip():
        raise ConfigError("metrics.host: must not be empty")
    require_token = _expect(raw.get("require_token", False), bool, "metrics.require_token", "true or false")
    return MetricsConfig(port=check_port(raw.get("port", default.port), "metrics.port"), host=host, require_token=require_token)


def _file(base: Path, value: Any, where: str) -> Path:
    _expect(value, str, where, "a file path")
    if not value.strip():
        raise ConfigError(f"{where}: must not be empty")
    return (base / value).resolve()


def _tls(raw: Any, base: Path, where: str) -> TlsSpec:
    _expect(raw, dict, where, "a mapping with 'cert', 'key' and optionally 'client_ca'")
    _unknown_keys(raw, _TLS_KEYS, where)
    for key in ("cert", "key"):
        if key not in raw:
            raise ConfigError(f"{where}: missing required key {key!r}")
    client_ca = raw.get("client_ca")
    return TlsSpec(
        cert=_file(base, raw["cert"], f"{where}.cert"),
        key=_file(base, raw["key"], f"{where}.key"),
        client_ca=_file(base, client_ca, f"{where}.client_ca") if client_ca is not None else None,
    )


def _listen_entry(raw: Any, base: Path, where: str) -> ListenSpec:
    if isinstance(raw, str):
        return ListenSpec(address=raw)
    _expect(raw, dict, where, "an address string or a mapping with 'address'")
    _unknown_keys(raw, _LISTEN_KEYS, where)
    if "address" not in raw:
        raise ConfigError(f"{where}: missing required key 'address'")
    address = _expect(raw["address"], str, f"{where}.address", "an address string")
    unix = address.startswith("unix:")
    tls = _tls(raw["tls"], base, f"{where}.tls") if raw.get("tls") is not None else None
    insecure = _expect(raw.get("insecure", False), bool, f"{where}.insecure", "true or false")
    mode = raw.get("socket_mode")
    group = raw.get("socket_group")
    if unix and tls is not None:
        raise ConfigError(f"{where}.tls: {address} is a unix socket, protected by its file mode (socket_mode/socket_group), not TLS")
    if not unix and (mode is not None or group is not None):
        raise ConfigError(f"{where}: socket_mode and socket_group apply to unix sockets, not {address}")
    if tls is not None and insecure:
        raise ConfigError(f"{where}: 'tls' and 'insecure: true' contradict each other")
    if mode is not None:
        _expect(mode, int, f"{where}.socket_mode", "an octal mode such as 0660")
        if not 0 <= mode <= 0o777 or mode & 0o007:
            raise ConfigError(f"{where}.socket_mode: {mode:#o} must give 'other' users nothing (at most 0770)")
    if group is not None:
        _expect(group, (str, int), f"{where}.socket_group", "a group name or id")
    return ListenSpec(address=address, tls=tls, insecure=insecure, socket_mode=mode, socket_group=group)


def check_listen(listen: tuple[ListenSpec, ...]) -> None:
    """Refuse plaintext TCP on an address that is not loopback, unless the entry says ``insecure: true``."""
    for spec in listen:
        if not spec.unix and spec.tls is None and not spec.insecure and not is_loopback(spec.address):
            raise ConfigError(
                f"listen: {spec.address} would serve plaintext beyond this host; add tls: {{cert, key}} to the entry, "
                "or insecure: true if the network is trusted"
            )


def _auth(raw: Any, base: Path) -> AuthConfig | None:
    if raw is None:
        return None
    _expect(raw, dict, "auth", "a mapping with 'token_file'")
    _unknown_keys(raw, {"token_file"}, "auth")
    if "token_file" not in raw:
        raise ConfigError("auth: missing required key 'token_file'")
    return AuthConfig(token_file=_file(base, raw["token_file"], "auth.token_file"))


def parse_config(raw: Any, path: Path) -> LoaderConfig:
    """Validate a parsed YAML document (no imports happen here)."""
    if raw is None:
        raw = {}
    _expect(raw, dict, str(path), "a mapping at the top level")
    _unknown_keys(raw, _TOP_KEYS, str(path))

    listen_raw = raw.get("listen", list(DEFAULT_LISTEN))
    if isinstance(listen_raw, str):
        listen_raw = [listen_raw]
    _expect(listen_raw, list, "listen", "an address or a list of addresses")
    if not listen_raw:
        raise ConfigError("listen: needs at least one address")
    listen = tuple(_listen_entry(a, path.parent, f"listen[{i}]") for i, a in enumerate(listen_raw))

    python_path_raw = raw.get("python_path", [])
    _expect(python_path_raw, list, "python_path", "a list of directories")
    base = path.parent
    python_path = tuple(
        str((base / _expect(p, str, f"python_path[{i}]", "a directory")).resolve())
        for i, p in enumerate(python_path_raw)
    )

    datasets_raw = raw.get("datasets")
    if not datasets_raw:
        raise ConfigError("datasets: the config defines no dataset")
    _expect(datasets_raw, dict, "datasets", "a mapping of name to dataset")
    datasets: dict[str, DatasetSpec] = {}
    for name, entry in datasets_raw.items():
        where = f"datasets.{name}"
        _expect(name, str, where, "a string name")
        _expect(entry, dict, where, "a mapping with at least 'dataset'")
        _unknown_keys(entry, _DATASET_KEYS, where)
        if "dataset" not in entry:
            raise ConfigError(f"{where}: missing required key 'dataset'")
        # An empty `args:` (YAML null) means none; anything else must have the right type.
        args = entry.get("args") if entry.get("args") is not None else []
        kwargs = entry.get("kwargs") if entry.get("kwargs") is not None else {}
        _expect(args, list, f"{where}.args", "a list")
        _expect(kwargs, dict, f"{where}.kwargs", "a mapping")
        build = entry.get("build", "per_worker")
        if build not in _BUILD_MODES:
            raise ConfigError(f"{where}.build: expected one of {', '.join(_BUILD_MODES)}, got {build!r}")
        datasets[name] = DatasetSpec(
            name=name,
            factory=_import_path(entry["dataset"], f"{where}.dataset"),
            args=tuple(args),
            kwargs=dict(kwargs),
            collate_fn=_import_path(entry["collate_fn"], f"{where}.collate_fn") if entry.get("collate_fn") else None,
            worker_init_fn=(
                _import_path(entry["worker_init_fn"], f"{where}.worker_init_fn")
                if entry.get("worker_init_fn")
                else None
            ),
            task_timeout=_seconds(entry["task_timeout"], f"{where}.task_timeout") if entry.get("task_timeout") is not None else None,
            build=build,
        )
    log_level = _expect(raw.get("log_level", "INFO"), str, "log_level", "a logging level name").upper()
    if log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"log_level: {log_level!r} is not one of DEBUG, INFO, WARNING, ERROR")
    log_format = raw.get("log_format", "text")
    if log_format not in LOG_FORMATS:
        raise ConfigError(f"log_format: expected one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    check_listen(listen)  # after the rest: a config with no datasets says that first
    auth = _auth(raw.get("auth"), path.parent)
    metrics = _metrics(raw["metrics"]) if "metrics" in raw else None
    if metrics is not None and metrics.require_token and auth is None:
        raise ConfigError("metrics.require_token: needs auth.token_file (the tokens scrapers must send)")
    return LoaderConfig(
        path=path,
        listen=listen,
        workers=_int_at_least(raw, "workers", 2, 1),
        python_path=python_path,
        datasets=datasets,
        chunk_bytes=_chunk_bytes(raw),
        max_window=_int_at_least(raw, "max_window", 64, 1),
        share_buffer=_int_at_least(raw, "share_buffer", 32, 0),
        shm_bytes_per_worker=_int_at_least(raw, "shm_bytes_per_worker", 1 << 30, 0),
        log_level=log_level,
        log_format=log_format,
        metrics=metrics,
        limits=_limits(raw.get("limits")),
        max_tasks_per_worker=_int_at_least(raw, "max_tasks_per_worker", 0, 0),
        worker_max_rss_mb=_int_at_least(raw, "worker_max_rss_mb", 0, 0),
        drain_timeout=_drain_timeout(raw.get("drain_timeout", 30.0)),
        auth=auth,
    )


def _drain_timeout(value: Any) -> float:
    if value == 0 and not isinstance(value, bool):
        return 0.0
    return _seconds(value, "drain_timeout")


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
