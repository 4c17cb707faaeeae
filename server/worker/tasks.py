"""Messages between the daemon and its worker processes.

These are pickled over the pool's own pipes: both ends are loaderd's code in
processes the daemon started, never a client. Array bytes of a finished batch
follow a ``BatchDone`` as raw buffers, not pickle. A worker sends with ``send_result``.
A task pipe carries ``TASK_FRAME`` frames: the daemon writes them (server/pool/task_pipe.py),
the worker reads them (server/worker/task_inbox.py).
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from multiprocessing.connection import Connection

from loaderd.server.cache.usage import CacheDelta
from loaderd.server.shm.arena import SlotRef

# A map-style batch's indices: a list to collate, or one index when auto_collation is off.
Indices = tuple[int, ...] | int


@dataclass(frozen=True)
class DatasetMeta:
    """What the client needs to plan: the dataset's kind and length."""

    iterable: bool
    length: int | None


# ------------------------------------------------------------- daemon -> worker


@dataclass(frozen=True)
class FetchTask:
    """Fetch and collate one batch of a map-style dataset."""

    stream_id: int
    seq: int
    dataset: str
    indices: Indices
    auto_collation: bool
    seed: int
    # Send the payload over the pipe, not in shared memory (the daemon could not map a slot).
    inline: bool = False
    # The batch's position in the client's epoch (its seed follows it); -1: ``seq``.
    position: int = -1
    # Its result may wait in the worker to go with the next ones (server/worker/result_group.py); the dispatcher sets it.
    grouped: bool = False


@dataclass(frozen=True)
class IterTask:
    """Produce batch ``batch_index`` of one replica of an iterable dataset."""

    stream_id: int
    seq: int
    dataset: str
    replica: int
    # torch's num_workers for this stream; 0 means one replica that sees no worker info.
    num_replicas: int
    batch_index: int
    batch_size: int  # 0 = no automatic batching
    drop_last: bool
    base_seed: int
    inline: bool = False  # as FetchTask.inline


@dataclass(frozen=True)
class ReleaseStream:
    """Forget a finished stream's iterable replicas."""

    stream_id: int


@dataclass(frozen=True)
class ReleaseSlot:
    """The daemon is done with a shared-memory segment: the worker may reuse it."""

    name: str


@dataclass(frozen=True)
class SettleCache:
    """``cache: auto`` decided for ``dataset`` (server/cache/auto.py): keep caching (and stop measuring), or stop using the cache."""

    dataset: str
    on: bool


# Work for a batch position (what producers hand out), and everything a worker's task pipe carries.
BatchTask = FetchTask | IterTask
Task = FetchTask | IterTask | ReleaseStream | ReleaseSlot | SettleCache

# One message on a task pipe: this header (the pickle's length, 4 bytes big-endian, as
# ``multiprocessing.connection`` frames short messages), then the pickle of a ``Task`` or ``None`` (the end).
TASK_FRAME = struct.Struct("!i")


# ------------------------------------------------------------- worker -> daemon


@dataclass(frozen=True)
class WorkerReady:
    worker_id: int
    datasets: dict[str, DatasetMeta]
    # Top-level packages that building the datasets imported in this worker, not in the fork server before it:
    # every worker holds its own copy of them (server/pool/pool.py says so once).
    imported: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerStartFailed:
    worker_id: int
    message: str


@dataclass(frozen=True)
class BatchDone:
    """A batch is ready: its payload is in ``slot``, or (no room in shared
    memory) ``len(buffer_offsets)`` raw buffers follow on the pipe."""

    stream_id: int
    seq: int
    value: bytes  # serialized loaderd.v1.Value
    payload_bytes: int
    slot: SlotRef | None
    buffer_offsets: tuple[int, ...] = ()
    # Segments the worker removed since its last batch (the daemon unmaps them).
    retired: tuple[str, ...] = ()
    # The dataset's item cache's counts for this batch (None: no cache:).
    cache: CacheDelta | None = None
    # Seconds a map-style batch took in its worker, from its task's turn to the batch collated (None: not timed): what
    # the worker's hold rule compares with HOLD_BELOW_S (server/worker/result_group.py), and the daemon's measure of a
    # dataset's quickness (server/scheduling/dispatcher.py), whose own clock sees a group's results arrive together.
    # Not in it: items the worker's threads started ahead (server/worker/run_ahead.py), the encoding and the send.
    made_s: float | None = None


@dataclass(frozen=True)
class BatchFailed:
    stream_id: int
    seq: int
    error: bytes  # serialized loaderd.v1.RemoteError


@dataclass(frozen=True)
class ReplicaExhausted:
    """The replica that ``seq`` asked for has no more batches."""

    stream_id: int
    seq: int


@dataclass(frozen=True)
class SlotsRetired:
    """An idle worker removed its idle segments (the daemon unmaps them): /dev/shm goes back between bursts."""

    retired: tuple[str, ...]


Result = WorkerReady | WorkerStartFailed | BatchDone | BatchFailed | ReplicaExhausted | SlotsRetired


def stream_of(result: Result) -> int | None:
    """The stream a worker's result is for; None for what concerns the worker alone."""
    if isinstance(result, (BatchDone, BatchFailed, ReplicaExhausted)):
        return result.stream_id
    return None


def send_result(conn: Connection, result: Result) -> None:
    """Send one result to the daemon (read there by ``ResultPipe``, server/pool/result_pipe.py).

    Plain pickle: results are loaderd's own dataclasses, and ``Connection.send``
    builds a ``ForkingPickler`` per message (copying torch's reducer table)."""
    conn.send_bytes(pickle.dumps(result, pickle.HIGHEST_PROTOCOL))
