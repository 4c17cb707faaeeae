from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DatasetInfo(_message.Message):
    __slots__ = ("name", "kind", "has_length", "length")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[DatasetInfo.Kind]
        MAP: _ClassVar[DatasetInfo.Kind]
        ITERABLE: _ClassVar[DatasetInfo.Kind]
    KIND_UNSPECIFIED: DatasetInfo.Kind
    MAP: DatasetInfo.Kind
    ITERABLE: DatasetInfo.Kind
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HAS_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: DatasetInfo.Kind
    has_length: bool
    length: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[DatasetInfo.Kind, str]] = ..., has_length: _Optional[bool] = ..., length: _Optional[int] = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets", "pool_workers")
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    POOL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    pool_workers: int
    def __init__(self, datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ..., pool_workers: _Optional[int] = ...) -> None: ...

class DescribeDatasetRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DescribeDatasetResponse(_message.Message):
    __slots__ = ("dataset", "pool_workers", "protocol_revision")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    POOL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_REVISION_FIELD_NUMBER: _ClassVar[int]
    dataset: DatasetInfo
    pool_workers: int
    protocol_revision: int
    def __init__(self, dataset: _Optional[_Union[DatasetInfo, _Mapping]] = ..., pool_workers: _Optional[int] = ..., protocol_revision: _Optional[int] = ...) -> None: ...

class OpenStream(_message.Message):
    __slots__ = ("dataset", "auto_collation", "batch_size", "drop_last", "num_workers", "base_seed", "window", "session_id", "stream_token", "start", "client", "share", "positioned", "protocol_revision", "direct_key")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    AUTO_COLLATION_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    BASE_SEED_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    POSITIONED_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_REVISION_FIELD_NUMBER: _ClassVar[int]
    DIRECT_KEY_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    auto_collation: bool
    batch_size: int
    drop_last: bool
    num_workers: int
    base_seed: int
    window: int
    session_id: int
    stream_token: int
    start: int
    client: str
    share: ShareSpec
    positioned: bool
    protocol_revision: int
    direct_key: bytes
    def __init__(self, dataset: _Optional[str] = ..., auto_collation: _Optional[bool] = ..., batch_size: _Optional[int] = ..., drop_last: _Optional[bool] = ..., num_workers: _Optional[int] = ..., base_seed: _Optional[int] = ..., window: _Optional[int] = ..., session_id: _Optional[int] = ..., stream_token: _Optional[int] = ..., start: _Optional[int] = ..., client: _Optional[str] = ..., share: _Optional[_Union[ShareSpec, _Mapping]] = ..., positioned: _Optional[bool] = ..., protocol_revision: _Optional[int] = ..., direct_key: _Optional[bytes] = ...) -> None: ...

class ShareSpec(_message.Message):
    __slots__ = ("name", "epoch", "fingerprint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    epoch: int
    fingerprint: str
    def __init__(self, name: _Optional[str] = ..., epoch: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class IndexBatch(_message.Message):
    __slots__ = ("indices", "position")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    position: int
    def __init__(self, indices: _Optional[_Iterable[int]] = ..., position: _Optional[int] = ...) -> None: ...

class PlanBatches(_message.Message):
    __slots__ = ("batches", "end", "consumed", "stalled_us", "released_leases")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    STALLED_US_FIELD_NUMBER: _ClassVar[int]
    RELEASED_LEASES_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[IndexBatch]
    end: bool
    consumed: int
    stalled_us: int
    released_leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batches: _Optional[_Iterable[_Union[IndexBatch, _Mapping]]] = ..., end: _Optional[bool] = ..., consumed: _Optional[int] = ..., stalled_us: _Optional[int] = ..., released_leases: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("open", "plan", "direct")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    open: OpenStream
    plan: PlanBatches
    direct: DirectRequests
    def __init__(self, open: _Optional[_Union[OpenStream, _Mapping]] = ..., plan: _Optional[_Union[PlanBatches, _Mapping]] = ..., direct: _Optional[_Union[DirectRequests, _Mapping]] = ...) -> None: ...

class DirectRequests(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ArrayRef(_message.Message):
    __slots__ = ("dtype", "shape", "strides", "offset", "nbytes", "scalar")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    strides: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    scalar: bool
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., strides: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., scalar: _Optional[bool] = ...) -> None: ...

class Sequence(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, items: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class NamedTuple(_message.Message):
    __slots__ = ("module", "qualname", "fields", "items")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    QUALNAME_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    module: str
    qualname: str
    fields: _containers.RepeatedScalarFieldContainer[str]
    items: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, module: _Optional[str] = ..., qualname: _Optional[str] = ..., fields: _Optional[_Iterable[str]] = ..., items: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class Mapping(_message.Message):
    __slots__ = ("type", "keys", "values")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    type: str
    keys: _containers.RepeatedCompositeFieldContainer[Value]
    values: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, type: _Optional[str] = ..., keys: _Optional[_Iterable[_Union[Value, _Mapping]]] = ..., values: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("tensor", "ndarray", "none", "bool_value", "int_value", "big_int", "float_value", "str_value", "bytes_value", "list", "tuple", "named_tuple", "mapping")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    NDARRAY_FIELD_NUMBER: _ClassVar[int]
    NONE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    BIG_INT_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    STR_VALUE_FIELD_NUMBER: _ClassVar[int]
    BYTES_VALUE_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    TUPLE_FIELD_NUMBER: _ClassVar[int]
    NAMED_TUPLE_FIELD_NUMBER: _ClassVar[int]
    MAPPING_FIELD_NUMBER: _ClassVar[int]
    tensor: ArrayRef
    ndarray: ArrayRef
    none: bool
    bool_value: bool
    int_value: int
    big_int: str
    float_value: float
    str_value: str
    bytes_value: bytes
    list: Sequence
    tuple: Sequence
    named_tuple: NamedTuple
    mapping: Mapping
    def __init__(self, tensor: _Optional[_Union[ArrayRef, _Mapping]] = ..., ndarray: _Optional[_Union[ArrayRef, _Mapping]] = ..., none: _Optional[bool] = ..., bool_value: _Optional[bool] = ..., int_value: _Optional[int] = ..., big_int: _Optional[str] = ..., float_value: _Optional[float] = ..., str_value: _Optional[str] = ..., bytes_value: _Optional[bytes] = ..., list: _Optional[_Union[Sequence, _Mapping]] = ..., tuple: _Optional[_Union[Sequence, _Mapping]] = ..., named_tuple: _Optional[_Union[NamedTuple, _Mapping]] = ..., mapping: _Optional[_Union[Mapping, _Mapping]] = ...) -> None: ...

class BatchHeader(_message.Message):
    __slots__ = ("seq", "value", "payload_bytes", "data", "slot")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    value: Value
    payload_bytes: int
    data: bytes
    slot: SlotHandle
    def __init__(self, seq: _Optional[int] = ..., value: _Optional[_Union[Value, _Mapping]] = ..., payload_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., slot: _Optional[_Union[SlotHandle, _Mapping]] = ...) -> None: ...

class SlotHandle(_message.Message):
    __slots__ = ("name", "size", "lease")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    lease: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., lease: _Optional[int] = ...) -> None: ...

class Batches(_message.Message):
    __slots__ = ("batches",)
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[BatchHeader]
    def __init__(self, batches: _Optional[_Iterable[_Union[BatchHeader, _Mapping]]] = ...) -> None: ...

class DataChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class RemoteError(_message.Message):
    __slots__ = ("seq", "type_module", "type_qualname", "message", "traceback", "where")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TYPE_MODULE_FIELD_NUMBER: _ClassVar[int]
    TYPE_QUALNAME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    type_module: str
    type_qualname: str
    message: str
    traceback: str
    where: str
    def __init__(self, seq: _Optional[int] = ..., type_module: _Optional[str] = ..., type_qualname: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ..., where: _Optional[str] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("batches", "keep_open_ms")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    KEEP_OPEN_MS_FIELD_NUMBER: _ClassVar[int]
    batches: int
    keep_open_ms: int
    def __init__(self, batches: _Optional[int] = ..., keep_open_ms: _Optional[int] = ...) -> None: ...

class SessionHello(_message.Message):
    __slots__ = ("pid", "protocol_revision", "resume_session_id")
    PID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_REVISION_FIELD_NUMBER: _ClassVar[int]
    RESUME_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    protocol_revision: int
    resume_session_id: int
    def __init__(self, pid: _Optional[int] = ..., protocol_revision: _Optional[int] = ..., resume_session_id: _Optional[int] = ...) -> None: ...

class SessionProof(_message.Message):
    __slots__ = ("token", "problem")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    problem: str
    def __init__(self, token: _Optional[bytes] = ..., problem: _Optional[str] = ...) -> None: ...

class SlotRelease(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, leases: _Optional[_Iterable[int]] = ...) -> None: ...

class AbandonStream(_message.Message):
    __slots__ = ("stream_token", "kept_leases")
    STREAM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KEPT_LEASES_FIELD_NUMBER: _ClassVar[int]
    stream_token: int
    kept_leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stream_token: _Optional[int] = ..., kept_leases: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("hello", "proof", "release", "abandon")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    hello: SessionHello
    proof: SessionProof
    release: SlotRelease
    abandon: AbandonStream
    def __init__(self, hello: _Optional[_Union[SessionHello, _Mapping]] = ..., proof: _Optional[_Union[SessionProof, _Mapping]] = ..., release: _Optional[_Union[SlotRelease, _Mapping]] = ..., abandon: _Optional[_Union[AbandonStream, _Mapping]] = ...) -> None: ...

class SessionChallenge(_message.Message):
    __slots__ = ("path", "session_id", "direct_socket")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECT_SOCKET_FIELD_NUMBER: _ClassVar[int]
    path: str
    session_id: int
    direct_socket: str
    def __init__(self, path: _Optional[str] = ..., session_id: _Optional[int] = ..., direct_socket: _Optional[str] = ...) -> None: ...

class SessionReady(_message.Message):
    __slots__ = ("session_id", "shm", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    shm: bool
    reason: str
    def __init__(self, session_id: _Optional[int] = ..., shm: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class SegmentsRetired(_message.Message):
    __slots__ = ("names", "prefixes")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    prefixes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., prefixes: _Optional[_Iterable[str]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("challenge", "ready", "retired")
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    challenge: SessionChallenge
    ready: SessionReady
    retired: SegmentsRetired
    def __init__(self, challenge: _Optional[_Union[SessionChallenge, _Mapping]] = ..., ready: _Optional[_Union[SessionReady, _Mapping]] = ..., retired: _Optional[_Union[SegmentsRetired, _Mapping]] = ...) -> None: ...

class Draining(_message.Message):
    __slots__ = ("stop_in_s",)
    STOP_IN_S_FIELD_NUMBER: _ClassVar[int]
    stop_in_s: float
    def __init__(self, stop_in_s: _Optional[float] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("batch", "chunk", "error", "end", "draining", "batches", "direct")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    batch: BatchHeader
    chunk: DataChunk
    error: RemoteError
    end: StreamEnd
    draining: Draining
    batches: Batches
    direct: DirectAttached
    def __init__(self, batch: _Optional[_Union[BatchHeader, _Mapping]] = ..., chunk: _Optional[_Union[DataChunk, _Mapping]] = ..., error: _Optional[_Union[RemoteError, _Mapping]] = ..., end: _Optional[_Union[StreamEnd, _Mapping]] = ..., draining: _Optional[_Union[Draining, _Mapping]] = ..., batches: _Optional[_Union[Batches, _Mapping]] = ..., direct: _Optional[_Union[DirectAttached, _Mapping]] = ...) -> None: ...

class DirectAttached(_message.Message):
    __slots__ = ("attached",)
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    attached: bool
    def __init__(self, attached: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "pid", "alive", "ready", "busy", "restarts", "batches")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    pid: int
    alive: bool
    ready: bool
    busy: int
    restarts: int
    batches: int
    def __init__(self, worker_id: _Optional[int] = ..., pid: _Optional[int] = ..., alive: _Optional[bool] = ..., ready: _Optional[bool] = ..., busy: _Optional[int] = ..., restarts: _Optional[int] = ..., batches: _Optional[int] = ...) -> None: ...

class DatasetStatus(_message.Message):
    __slots__ = ("info", "batches_computed", "samples_fetched", "batches_delivered", "errors", "open_streams", "queued", "cache")
    INFO_FIELD_NUMBER: _ClassVar[int]
    BATCHES_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    OPEN_STREAMS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    info: DatasetInfo
    batches_computed: int
    samples_fetched: int
    batches_delivered: int
    errors: int
    open_streams: int
    queued: int
    cache: CacheStatus
    def __init__(self, info: _Optional[_Union[DatasetInfo, _Mapping]] = ..., batches_computed: _Optional[int] = ..., samples_fetched: _Optional[int] = ..., batches_delivered: _Optional[int] = ..., errors: _Optional[int] = ..., open_streams: _Optional[int] = ..., queued: _Optional[int] = ..., cache: _Optional[_Union[CacheStatus, _Mapping]] = ...) -> None: ...

class CacheStatus(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "items", "hits", "misses", "saved_cpu_s", "not_stored", "mode", "decision")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    SAVED_CPU_S_FIELD_NUMBER: _ClassVar[int]
    NOT_STORED_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    tier: str
    capacity_bytes: int
    used_bytes: int
    items: int
    hits: int
    misses: int
    saved_cpu_s: float
    not_stored: int
    mode: str
    decision: str
    def __init__(self, tier: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., items: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., saved_cpu_s: _Optional[float] = ..., not_stored: _Optional[int] = ..., mode: _Optional[str] = ..., decision: _Optional[str] = ...) -> None: ...

class StreamStatus(_message.Message):
    __slots__ = ("stream_id", "peer", "client", "dataset", "window", "delivered", "consumed", "in_flight", "stalled_s", "open_s", "share", "shm", "identity")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    STALLED_S_FIELD_NUMBER: _ClassVar[int]
    OPEN_S_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    peer: str
    client: str
    dataset: str
    window: int
    delivered: int
    consumed: int
    in_flight: int
    stalled_s: float
    open_s: float
    share: str
    shm: bool
    identity: str
    def __init__(self, stream_id: _Optional[int] = ..., peer: _Optional[str] = ..., client: _Optional[str] = ..., dataset: _Optional[str] = ..., window: _Optional[int] = ..., delivered: _Optional[int] = ..., consumed: _Optional[int] = ..., in_flight: _Optional[int] = ..., stalled_s: _Optional[float] = ..., open_s: _Optional[float] = ..., share: _Optional[str] = ..., shm: _Optional[bool] = ..., identity: _Optional[str] = ...) -> None: ...

class ShareStatus(_message.Message):
    __slots__ = ("name", "epoch", "dataset", "consumers", "produced", "recomputed", "buffered")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    PRODUCED_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_FIELD_NUMBER: _ClassVar[int]
    name: str
    epoch: int
    dataset: str
    consumers: int
    produced: int
    recomputed: int
    buffered: int
    def __init__(self, name: _Optional[str] = ..., epoch: _Optional[int] = ..., dataset: _Optional[str] = ..., consumers: _Optional[int] = ..., produced: _Optional[int] = ..., recomputed: _Optional[int] = ..., buffered: _Optional[int] = ...) -> None: ...

class ClientStatus(_message.Message):
    __slots__ = ("client", "identity", "dataset", "open_streams", "batches", "waited_s", "active_s")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    OPEN_STREAMS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_S_FIELD_NUMBER: _ClassVar[int]
    client: str
    identity: str
    dataset: str
    open_streams: int
    batches: int
    waited_s: float
    active_s: float
    def __init__(self, client: _Optional[str] = ..., identity: _Optional[str] = ..., dataset: _Optional[str] = ..., open_streams: _Optional[int] = ..., batches: _Optional[int] = ..., waited_s: _Optional[float] = ..., active_s: _Optional[float] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("workers", "min_workers", "max_workers", "elastic", "target", "reason", "held", "starved_s", "busy_s", "limited_s")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    STARVED_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    LIMITED_S_FIELD_NUMBER: _ClassVar[int]
    workers: int
    min_workers: int
    max_workers: int
    elastic: bool
    target: int
    reason: str
    held: str
    starved_s: float
    busy_s: float
    limited_s: float
    def __init__(self, workers: _Optional[int] = ..., min_workers: _Optional[int] = ..., max_workers: _Optional[int] = ..., elastic: _Optional[bool] = ..., target: _Optional[int] = ..., reason: _Optional[str] = ..., held: _Optional[str] = ..., starved_s: _Optional[float] = ..., busy_s: _Optional[float] = ..., limited_s: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("version", "uptime_s", "workers", "datasets", "streams", "shares", "sessions", "clients", "pool", "paused_sessions")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAUSED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_s: float
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetStatus]
    streams: _containers.RepeatedCompositeFieldContainer[StreamStatus]
    shares: _containers.RepeatedCompositeFieldContainer[ShareStatus]
    sessions: int
    clients: _containers.RepeatedCompositeFieldContainer[ClientStatus]
    pool: PoolStatus
    paused_sessions: int
    def __init__(self, version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., datasets: _Optional[_Iterable[_Union[DatasetStatus, _Mapping]]] = ..., streams: _Optional[_Iterable[_Union[StreamStatus, _Mapping]]] = ..., shares: _Optional[_Iterable[_Union[ShareStatus, _Mapping]]] = ..., sessions: _Optional[int] = ..., clients: _Optional[_Iterable[_Union[ClientStatus, _Mapping]]] = ..., pool: _Optional[_Union[PoolStatus, _Mapping]] = ..., paused_sessions: _Optional[int] = ...) -> None: ...
