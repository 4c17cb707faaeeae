"""A seeded fuzzer for the daemon's gRPC surface, shared by tests/integration/test_fuzz.py and tests/bench/bench_fuzz.py.

``RequestFuzzer(seed)`` yields ``Case`` objects: one gRPC call each,
to every method of ``loaderd.v1.Loader`` and to ``grpc.health.v1.Health/Check``,
with malformed and absurd bodies: random bytes, valid messages of the wrong
type, hand-made wire encodings (wrong wire types, truncations, out-of-range
varints, mixed oneofs, invalid UTF-8, deep group nesting), extreme integers in
every numeric field, long strings (up to a few MiB) in every string field,
unknown dataset names, and streams whose messages come out of order, twice, or
not at all. The same seed gives the same cases in the same order.

``FuzzRun`` sends the cases on a few client threads (raw bytes both ways:
``request_serializer=None``, ``response_deserializer=None``), checks every
reply (``check_outcome``: allowed status codes only, bounded details, replies
that parse, absurd opens refused) and counts status codes per RPC. ``ProcStats`` reads the daemon's
file descriptors, threads and RSS from /proc; ``shm_entries`` lists its
/dev/shm files; ``check_epochs`` compares a real ``RemoteDataLoader`` epoch
with torch's ``DataLoader`` after the run.
"""

from __future__ import annotations

import os
import queue
import random
import re
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import message as pb_message
from google.protobuf import unknown_fields
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_health.v1 import health_pb2

from loaderd.server.process import heap
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire import framing
from loaderd.wire.limits import PROTOCOL_REVISION

# ------------------------------------------------------------------ the footprint a run must come back to

# What a fuzz run's daemon footprint must come back to once idle, after a warm-up round
# (tests/integration/test_fuzz.py and tests/bench/bench_fuzz.py).
# For the footprint to come back: the daemon lets a handler thread idle 30 s
# before it exits, and gives free heap pages back every 30 s while idle.
FOOTPRINT_SETTLE_S = 75.0
FD_MARGIN = 4  # a channel of the run's own Status or health calls, still closing
THREAD_MARGIN = 4  # a stream's plan reader or a session's reader, on its way out
# RSS after the warm-up already holds the allocator's high-water mark for the
# largest messages (a few MiB each, on up to 40 handler threads at once). 30 MB
# more over test_fuzz's 9,000 further calls is ~3.4 KB a call: RSS that stays above that
# once the daemon is idle is memory kept per call, i.e. a leak (or allocator
# caching that grows with the calls). On top of that, the free memory glibc keeps
# at the top of the daemon's thread arena by design (server/process/heap.py: up to
# TRIM_THRESHOLD_BYTES, which malloc_trim does not give back for thread arenas):
# whether it is there when the warm-up is measured, or at the end, is chance (a
# run failed at +30.5 MB, anon 41.5 -> 72.1 MB, with the same code passing flat;
# bench_fuzz's smoke run at +30.3 MB, anon 26.4 -> 56.7 MB, before it used this bound).
RSS_GROWTH_KB = 30 * 1024 + heap.TRIM_THRESHOLD_BYTES * (heap.ARENAS - 1) // 1024

# ------------------------------------------------------------------ what the daemon serves

SQUARES_N = 64
BIG_N = 20480  # 16 bytes a sample: a batch of 5120 is 80 KiB, over the 64 KiB inline threshold (a slot)
BIG_BATCH = 5120
FAILING_N = 20
STREAM_N = 30

# The fuzz daemon's datasets (tests/support/datasets.py), cheap to serve.
FUZZ_DATASETS: dict[str, Any] = {
    "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": SQUARES_N}},
    "failing": {"dataset": "support.datasets:Failing", "kwargs": {"n": FAILING_N, "bad": [3, 11], "kind": "ValueError"}},
    "stream": {"dataset": "support.datasets:Stream", "kwargs": {"n": STREAM_N}},
    "squares-big": {"dataset": "support.datasets:Squares", "kwargs": {"n": BIG_N}},
}
MAP_DATASETS = {"squares": SQUARES_N, "failing": FAILING_N, "squares-big": BIG_N}
ITERABLE_DATASETS = ("stream",)
# One 1 MiB segment per worker at most (the smallest segment): the daemon's
# /dev/shm footprint has a fixed ceiling, so "no more entries than before" is exact.
FUZZ_DAEMON_OPTIONS: dict[str, Any] = {"shm_bytes_per_worker": 1 << 20}
FUZZ_WORKERS = 2

# ------------------------------------------------------------------ the RPCs


@dataclass(frozen=True)
class Rpc:
    """One method: its path, shape and message classes."""

    name: str
    path: str
    streaming: bool
    request: type[pb_message.Message]
    response: type[pb_message.Message]


RPCS: dict[str, Rpc] = {
    rpc.name: rpc
    for rpc in (
        Rpc("ListDatasets", "/loaderd.v1.Loader/ListDatasets", False, pb.ListDatasetsRequest, pb.ListDatasetsResponse),
        Rpc(
            "DescribeDataset",
            "/loaderd.v1.Loader/DescribeDataset",
            False,
            pb.DescribeDatasetRequest,
            pb.DescribeDatasetResponse,
        ),
        Rpc("StreamBatches", "/loaderd.v1.Loader/StreamBatches", True, pb.StreamRequest, pb.StreamResponse),
        Rpc("Session", "/loaderd.v1.Loader/Session", True, pb.SessionRequest, pb.SessionResponse),
        Rpc("Status", "/loaderd.v1.Loader/Status", False, pb.StatusRequest, pb.StatusResponse),
        Rpc(
            "Health/Check",
            "/grpc.health.v1.Health/Check",
            False,
            health_pb2.HealthCheckRequest,
            health_pb2.HealthCheckResponse,
        ),
    )
}
UNARY = [name for name, rpc in RPCS.items() if not rpc.streaming]

C = grpc.StatusCode
ALLOWED_CODES = frozenset(
    {
        C.OK,
        C.INVALID_ARGUMENT,
        C.NOT_FOUND,
        C.FAILED_PRECONDITION,
        C.ABORTED,  # a stream naming a session the daemon does not know (a client retries with a new one)
        C.RESOURCE_EXHAUSTED,
        C.OUT_OF_RANGE,
        C.CANCELLED,
        C.DEADLINE_EXCEEDED,  # only from the client's own deadline on a streaming call (check_outcome)
    }
)
MAX_DETAILS = 4096
UNARY_TIMEOUT_S = 10.0  # a unary call that takes this long means the daemon stalled
STREAM_TIMEOUT_S = 2.0  # a streaming call the daemon keeps open ends here, on the client side
SCENARIO_TIMEOUT_S = 5.0
EXTREME_TIMEOUT_S = 6.0
MAX_RESPONSES = 4096  # a streaming call is cancelled after reading this many replies
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # Take trailers of any size, so over-long error details reach check_outcome
    # instead of being turned into a RESOURCE_EXHAUSTED by this client's own limit.
    ("grpc.max_metadata_size", 64 << 20),
    ("grpc.absolute_max_metadata_size", 64 << 20),
]

# ------------------------------------------------------------------ numbers

UINT32_EDGES = [0, 1, 2, 3, 7, 64, 255, 1000, 65535, 65536, 1 << 20, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
UINT64_EDGES = [*UINT32_EDGES, 2 ** 32, 2 ** 53, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 2, 2 ** 64 - 1]
INT64_EDGES = [0, 1, -1, 2, -2, 2**31 - 1, -(2**31), 2**32 - 1, 2**53, -(2**53), 2**63 - 1, -(2**63), -(2**63) + 1]
# The edges most likely to overflow arithmetic (n + 1, n * k) in the daemon: drawn more often.
TOP_EDGES = {32: [2**31 - 1, 2**32 - 1], 64: [2**63 - 1, 2**64 - 1, 2**64 - 2]}
# One extreme in one numeric field of an otherwise sane stream, cycled through every
# (field, value) pair and every dataset (RequestFuzzer.extreme_stream).
EXTREME_FIELDS = [
    ("open", "batch_size", 32),
    ("open", "num_workers", 32),
    ("open", "window", 32),
    ("open", "base_seed", -64),
    ("open", "session_id", 64),
    ("open", "stream_token", 64),
    ("open", "start", 64),
    ("share", "epoch", 64),
    ("plan", "consumed", 64),
    ("plan", "stalled_us", 64),
]
EXTREMES = {32: [2**31 - 1, 2**32 - 1], 64: [2**63, 2**64 - 1], -64: [-(2**63), 2**63 - 1]}
EXTREME_COMBOS = [(where, name, value) for where, name, bits in EXTREME_FIELDS for value in EXTREMES[bits]]
# Varints no well-formed encoder writes into a 32-bit field, and over-long ones.
RAW_VARINTS = [2**32, 2**63, 2**64 - 1, -1, -(2**31)]
MASK64 = (1 << 64) - 1

# ------------------------------------------------------------------ wire encoding by hand


def varint(n: int) -> bytes:
    """Protobuf base-128 varint; negative numbers as their 64-bit two's complement (10 bytes)."""
    return framing.varint(n & MASK64)


def tag(number: int, wire_type: int) -> bytes:
    return varint((number << 3) | wire_type)


def f_varint(number: int, value: int) -> bytes:
    return tag(number, 0) + varint(value)


def f_bytes(number: int, payload: bytes) -> bytes:
    return tag(number, 2) + varint(len(payload)) + payload


# ------------------------------------------------------------------ cases


@dataclass
class Case:
    """One call: its RPC, what to send, and how to end it."""

    index: int
    rpc: str
    kind: str  # the generator that made it (tallied, and named in reproducers)
    messages: list[bytes]
    timeout: float
    # Streaming: keep the request side open after ``messages`` (until the call ends) instead of half-closing.
    hold_open: bool = False
    # Session: answer the challenge with the token read from the daemon's file, then send ``after_challenge``.
    real_proof: bool = False
    after_challenge: list[bytes] = field(default_factory=list)
    # Streaming: cancel after this many replies (a client that stops early).
    cancel_after: int | None = None
    # A call on a channel of its own, closed right after (connection churn).
    fresh_channel: bool = False
    # The shared-memory scenario: a real session, then a stream with its id (see FuzzRun._shm_scenario).
    scenario: dict[str, Any] | None = None

    def describe(self, limit: int = 6) -> str:
        """A short, readable reproducer of this call."""
        rpc = RPCS[self.rpc]
        parts = [describe_bytes(m, rpc.request) for m in self.messages[:limit]]
        if len(self.messages) > limit:
            parts.append(f"... {len(self.messages) - limit} more")
        text = f"case #{self.index} [{self.kind}] {rpc.path}({', '.join(parts) or 'no messages'})"
        if self.real_proof:
            after = [describe_bytes(m, rpc.request) for m in self.after_challenge[:limit]]
            text += f" then proof(token read from the challenge file){''.join(', ' + a for a in after)}"
        if self.scenario is not None:
            text += f" scenario={self.scenario}"
        flags = [f"timeout={self.timeout:g}s"]
        if rpc.streaming:
            flags.append("request side held open" if self.hold_open else "half-closed after the messages")
        if self.cancel_after is not None:
            flags.append(f"cancelled after {self.cancel_after} replies")
        if self.fresh_channel:
            flags.append("own channel")
        return f"{text} [{'; '.join(flags)}]"

    @property
    def bytes_sent(self) -> int:
        return sum(map(len, self.messages)) + sum(map(len, self.after_challenge))


def _short(value: Any, limit: int = 48) -> str:
    text = repr(value)
    if len(text) <= limit:
        return text
    length = len(value) if isinstance(value, (str, bytes)) else len(text)
    return f"{text[:limit]}...<{length} {'chars' if isinstance(value, str) else 'bytes'}>"


def describe_message(msg: pb_message.Message, depth: int = 0) -> str:
    """``Type(field=value, ...)`` with long strings, bytes and lists shortened."""
    items = []
    for fd, value in msg.ListFields():
        if fd.message_type is not None:
            if fd.is_repeated:
                shown = [describe_message(v, depth + 1) for v in list(value)[:3]]
                more = f", ...<{len(value)} items>" if len(value) > 3 else ""
                items.append(f"{fd.name}=[{', '.join(shown)}{more}]")
            else:
                items.append(f"{fd.name}={describe_message(value, depth + 1)}")
        elif fd.is_repeated:
            scalars = ", ".join(_short(v) for v in list(value)[:4])
            more = f", ...<{len(value)} items>" if len(value) > 4 else ""
            items.append(f"{fd.name}=[{scalars}{more}]")
        else:
            items.append(f"{fd.name}={_short(value)}")
    unknown = len(unknown_fields.UnknownFieldSet(msg))
    if unknown:
        items.append(f"<{unknown} unknown fields>")
    return f"{type(msg).__name__}({', '.join(items)})"


def describe_bytes(data: bytes, message_type: type[pb_message.Message]) -> str:
    """How ``data`` parses as ``message_type``, or its first bytes if it does not."""
    try:
        return describe_message(message_type.FromString(data))
    except Exception:
        head = data[:24].hex()
        return f"raw<{len(data)} bytes: {head}{'...' if len(data) > 24 else ''}; not a valid {message_type.__name__}>"


# ------------------------------------------------------------------ the generator

_INTEGER_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_BOOL,
        FieldDescriptor.TYPE_ENUM,
    }
)

_ALPHABET = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/ "
    "\x00\x01\x7f\n\t\"'\\%{}$é中ʼ\u200b\ufeff😀\U0010fffd"
)


class RequestFuzzer:
    """Makes ``Case``s from a seed: the same seed, the same cases in the same order."""

    def __init__(self, seed: int, *, stream_share: float = 0.055, huge_share: float = 0.01) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.index = 0
        self.stream_share = stream_share
        self.huge_share = huge_share
        self.session_pids = [os.getpid(), 0, 1, 2**31 - 1, 2**32 - 1]
        self.extremes = 0  # extreme_stream cases made so far

    # ------------------------------------------------------------ scalars

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def u32(self, typical: Sequence[int] = (0, 1, 2, 4, 8)) -> int:
        r = self.rng
        pick = r.random()
        if pick < 0.15:
            return r.choice(TOP_EDGES[32])
        return r.choice(UINT32_EDGES) if pick < 0.45 else r.choice(typical)

    def u64(self, typical: Sequence[int] = (0, 1, 2, 3)) -> int:
        r = self.rng
        pick = r.random()
        if pick < 0.15:
            return r.choice(TOP_EDGES[64])
        return r.choice(UINT64_EDGES) if pick < 0.45 else r.choice(typical)

    def i64(self, typical: Sequence[int] = (0, 1, 42, 12345)) -> int:
        r = self.rng
        if r.random() < 0.45:
            return r.choice(INT64_EDGES)
        if r.random() < 0.2:
            return r.randrange(-(2**63), 2**63)
        return r.choice(typical)

    def length(self) -> int:
        """A string or payload length: mostly short, sometimes long, rarely a few MiB."""
        r = self.rng.random()
        if r < self.huge_share:
            return self.rng.randrange(1 << 20, 3 << 20)
        if r < self.huge_share + 0.04:
            return self.rng.randrange(4097, 1 << 17)
        if r < 0.30:
            return self.rng.randrange(65, 4097)
        return self.rng.randrange(0, 65)

    def text(self, n: int | None = None) -> str:
        n = self.length() if n is None else n
        if n <= 0:
            return ""
        block = "".join(self.rng.choices(_ALPHABET, k=min(n, 97)))
        return (block * (n // len(block) + 1))[:n]

    def blob(self, n: int | None = None) -> bytes:
        n = self.length() if n is None else n
        if n > 4096:  # repeat a random block: fast, and still deterministic
            block = self.rng.randbytes(4096)
            return (block * (n // 4096 + 1))[:n]
        return self.rng.randbytes(n)

    def dataset_name(self) -> str:
        r = self.rng
        known = list(MAP_DATASETS) + list(ITERABLE_DATASETS)
        pick = r.random()
        if pick < 0.55:
            return r.choice(known)
        name = r.choice(known)
        return r.choice(
            [
                "",
                "no-such-dataset",
                name.upper(),
                name + " ",
                " " + name,
                name + "\x00",
                name + "\n",
                "../" + name,
                name * 2,
                "*",
                ".",
                name[:-1],
                self.text(),
                self.text(r.randrange(1025, 1 << 16)),
                self.text(r.randrange(1 << 20, 3 << 20)) if r.random() < 0.1 else self.text(5000),
            ]
        )

    # ------------------------------------------------------------ messages

    def open_stream(self, dataset: str | None = None) -> pb.OpenStream:
        r = self.rng
        name = self.dataset_name() if dataset is None else dataset
        auto = r.random() < 0.75
        # Mostly this daemon's revision (the rest of the message is what gets fuzzed), now and then another.
        revision = PROTOCOL_REVISION if r.random() < 0.95 else self.u32((0, PROTOCOL_REVISION - 1, PROTOCOL_REVISION + 1))
        m = pb.OpenStream(dataset=name, auto_collation=auto, protocol_revision=revision)
        if r.random() < 0.5:
            m.batch_size = self.u32((0, 1, 4, 8) if auto else (0,))
        if r.random() < 0.3:
            m.drop_last = True
        if r.random() < 0.5:
            m.num_workers = self.u32((0, 1, 2, 3))
        if r.random() < 0.5:
            m.base_seed = self.i64()
        if r.random() < 0.6:
            m.window = self.u32((1, 2, 4, 8))
        if r.random() < 0.2:
            m.session_id = self.u64((1, 2, 3, 99))
        if r.random() < 0.4:
            m.stream_token = self.u64()
        if r.random() < 0.4:
            m.start = self.u64((0, 1, 2, 5))
        if r.random() < 0.5:
            m.client = self.text(r.randrange(1 << 20, 3 << 20)) if r.random() < 0.1 else self.text()
        if r.random() < 0.2:
            m.share.CopyFrom(self.share_spec())
        return m

    def share_spec(self) -> pb.ShareSpec:
        r = self.rng
        name = r.choice(["s0", "s1", "", self.text(), self.text(r.randrange(1 << 20, 2 << 20)) if r.random() < 0.3 else "s2"])
        return pb.ShareSpec(
            name=name,
            epoch=self.u64((0, 1)),
            fingerprint=r.choice(["", "fp-a", "fp-b", self.text()]),
        )

    def indices(self, dataset: str) -> list[int]:
        r = self.rng
        n = MAP_DATASETS.get(dataset, SQUARES_N)
        pick = r.random()
        if pick < 0.03:
            return []
        if pick < 0.05:
            # A huge index list; its first index is out of range so the worker fails it at once.
            return [2**62] + [0] * r.randrange(1 << 16, 1 << 18)
        if pick < 0.10 and dataset == "squares-big":
            start = r.randrange(0, n - BIG_BATCH)
            return list(range(start, start + BIG_BATCH))
        count = r.choice([1, 1, 2, 3, 4, 7, 8, 16, 64])
        out = []
        for _ in range(count):
            q = r.random()
            if q < 0.8:
                out.append(r.randrange(0, n))
            elif q < 0.9:
                out.append(r.randrange(-n, 0))
            else:
                out.append(r.choice([*INT64_EDGES, n, -n - 1]))
        return out

    def plan(self, dataset: str, end: bool | None = None) -> pb.PlanBatches:
        r = self.rng
        count = r.choice([0, 1, 1, 2, 3, 4, 8]) if r.random() < 0.97 else r.choice([64, 1000, 5000])
        batches = [pb.IndexBatch(indices=self.indices(dataset)) for _ in range(min(count, 8))]
        if count > 8:  # many small batches
            batches += [pb.IndexBatch(indices=[r.randrange(0, 4)]) for _ in range(count - 8)]
        plan = pb.PlanBatches(batches=batches, end=r.random() < 0.6 if end is None else end)
        if r.random() < 0.3:
            plan.consumed = self.u64()
        if r.random() < 0.3:
            plan.stalled_us = self.u64()
        return plan

    def wrong_type_message(self) -> bytes:
        """A valid message of some type, most likely not the one the method takes."""
        r = self.rng
        makers: list[Callable[[], pb_message.Message]] = [
            lambda: pb.StreamRequest(open=self.open_stream()),
            lambda: pb.StreamRequest(plan=self.plan("squares")),
            lambda: self.open_stream(),
            lambda: self.plan("squares"),
            lambda: pb.SessionRequest(hello=pb.SessionHello(pid=self.u32(), protocol_revision=PROTOCOL_REVISION)),
            lambda: pb.SessionRequest(proof=pb.SessionProof(token=self.blob(), problem=self.text())),
            lambda: pb.SessionRequest(release=pb.SlotRelease(leases=[self.u64() for _ in range(r.randrange(0, 8))])),
            lambda: pb.SessionRequest(abandon=pb.AbandonStream(stream_token=self.u64())),
            lambda: pb.DescribeDatasetRequest(name=self.dataset_name()),
            lambda: pb.StatusResponse(version=self.text(), uptime_s=r.random(), sessions=self.u32()),
            lambda: pb.ListDatasetsResponse(
                datasets=[pb.DatasetInfo(name=self.text(), kind=r.choice([0, 1, 2]), length=self.i64())],
                pool_workers=self.u32(),
            ),
            lambda: pb.StreamResponse(error=pb.RemoteError(seq=self.u64(), message=self.text())),
            lambda: pb.StreamResponse(batch=pb.BatchHeader(seq=self.u64(), payload_bytes=self.u64(), data=self.blob())),
            lambda: pb.SessionResponse(challenge=pb.SessionChallenge(path=self.text())),
            lambda: health_pb2.HealthCheckRequest(service=self.text()),
            lambda: health_pb2.HealthCheckResponse(status=r.choice([0, 1, 2, 3])),
        ]
        return r.choice(makers)().SerializeToString()

    def raw_wire(self, rpc: str) -> bytes:
        """A hand-made encoding: the fields of the method's message (and others), bent."""
        r = self.rng
        fields = [fd for fd in RPCS[rpc].request.DESCRIPTOR.fields] or [None]
        out = bytearray()
        for _ in range(r.randrange(1, 6)):
            fd = r.choice(fields)
            number = fd.number if fd is not None and r.random() < 0.8 else r.choice([1, 2, 3, 15, 16, 2**29 - 1, 19000])
            mode = r.randrange(9)
            if mode == 0:  # out-of-range or over-long varint
                out += tag(number, 0) + varint(r.choice(RAW_VARINTS + UINT64_EDGES))
            elif mode == 1:  # a varint with 11 continuation bytes
                out += tag(number, 0) + b"\xff" * 10 + b"\x01"
            elif mode == 2:  # length-delimited with a length beyond the message
                out += tag(number, 2) + varint(r.choice([1 << 20, 2**31 - 1, 2**63])) + self.blob(8)
            elif mode == 3:  # invalid UTF-8 where a string may be
                out += f_bytes(number, r.choice([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"ok\x80"]))
            elif mode == 4:  # wrong wire type: fixed64 / fixed32
                out += tag(number, r.choice([1, 5])) + self.rng.randbytes(8 if r.random() < 0.5 else 4)
            elif mode == 5:  # unmatched or deeply nested groups
                depth = r.choice([1, 5, 99, 100, 101, 1000, 20000])
                out += tag(number, 3) * depth + (tag(number, 4) * depth if r.random() < 0.5 else b"")
            elif mode == 6:  # a nested message of random bytes
                out += f_bytes(number, self.blob(r.randrange(0, 64)))
            elif mode == 7:  # deep length-delimited nesting
                inner = b""
                for _ in range(r.choice([10, 100, 200])):
                    inner = f_bytes(number, inner)
                out += inner
            else:  # field number 0, or a reserved wire type
                out += r.choice([b"\x00", b"\x06", b"\x07", tag(0, 2) + b"\x00"])
        if r.random() < 0.3:  # truncate
            out = out[: r.randrange(0, len(out) + 1)]
        return bytes(out)

    def raw_numbers(self, descriptor: Descriptor, depth: int = 0) -> bytes:
        """A message of ``descriptor``'s type whose integer fields hold varints no encoder would write
        there (-1 and 2**64-1 in a uint32, ...); strings are valid names or text."""
        r = self.rng
        out = bytearray()
        for fd in descriptor.fields:
            if r.random() < 0.3:
                continue
            if fd.type in _INTEGER_TYPES:
                values = [r.choice(RAW_VARINTS + UINT64_EDGES) for _ in range(r.choice([1, 1, 3]) if fd.is_repeated else 1)]
                if fd.is_repeated:  # packed
                    out += f_bytes(fd.number, b"".join(varint(v) for v in values))
                else:
                    out += f_varint(fd.number, values[0])
            elif fd.type == FieldDescriptor.TYPE_STRING:
                text = r.choice(list(MAP_DATASETS) + list(ITERABLE_DATASETS)) if fd.name == "dataset" else self.text(r.randrange(0, 40))
                out += f_bytes(fd.number, text.encode())
            elif fd.type == FieldDescriptor.TYPE_BYTES:
                out += f_bytes(fd.number, self.blob(r.randrange(0, 64)))
            elif fd.type == FieldDescriptor.TYPE_MESSAGE and depth < 3:
                for _ in range(r.choice([1, 1, 2]) if fd.is_repeated else 1):
                    out += f_bytes(fd.number, self.raw_numbers(fd.message_type, depth + 1))
        return bytes(out)

    def mutated(self, data: bytes) -> bytes:
        """``data`` with a few bytes flipped, cut short, or spliced with noise."""
        r = self.rng
        buf = bytearray(data)
        for _ in range(r.randrange(1, 4)):
            op = r.randrange(3)
            if op == 0 and buf:
                buf[r.randrange(len(buf))] ^= 1 << r.randrange(8)
            elif op == 1 and buf:
                del buf[r.randrange(len(buf)) :]
            else:
                pos = r.randrange(len(buf) + 1)
                buf[pos:pos] = r.randbytes(r.randrange(1, 8))
        return bytes(buf)

    def mixed_oneof(self, rpc: str) -> bytes:
        """A StreamRequest or SessionRequest carrying several of its oneof's fields at once."""
        if rpc == "StreamBatches":
            parts = [f_bytes(1, self.open_stream("squares").SerializeToString()), f_bytes(2, self.plan("squares").SerializeToString())]
        else:
            parts = [
                f_bytes(1, pb.SessionHello(pid=self.u32(), protocol_revision=PROTOCOL_REVISION).SerializeToString()),
                f_bytes(2, pb.SessionProof(token=self.blob(32)).SerializeToString()),
                f_bytes(3, pb.SlotRelease(leases=[self.u64()]).SerializeToString()),
                f_bytes(4, pb.AbandonStream(stream_token=self.u64()).SerializeToString()),
            ]
        self.rng.shuffle(parts)
        return b"".join(parts[: self.rng.randrange(2, len(parts) + 1)])

    # ------------------------------------------------------------ unary bodies

    def unary_body(self, rpc: str) -> tuple[str, bytes]:
        r = self.rng
        pick = r.random()
        if pick < 0.22:
            return "garbage", self.blob()
        if pick < 0.36:
            return "wrong-type", self.wrong_type_message()
        if pick < 0.50:
            return "raw-wire", self.raw_wire(rpc)
        if pick < 0.56:
            return "empty", b""
        if pick < 0.64:
            return "mutated", self.mutated(self.valid_unary(rpc))
        return "valid", self.valid_unary(rpc)

    def valid_unary(self, rpc: str) -> bytes:
        if rpc == "DescribeDataset":
            return pb.DescribeDatasetRequest(name=self.dataset_name()).SerializeToString()
        if rpc == "Health/Check":
            service = self.rng.choice(["", "loaderd.v1.Loader", "grpc.health.v1.Health", "no.such.Service", self.text()])
            return health_pb2.HealthCheckRequest(service=service).SerializeToString()
        return b""  # ListDatasetsRequest and StatusRequest have no fields

    # ------------------------------------------------------------ streams

    def stream_messages(self) -> tuple[str, list[bytes], bool]:
        """StreamBatches: (kind, messages, hold the request side open)."""
        r = self.rng
        pick = r.random()
        hold = r.random() < 0.12
        if pick < 0.50:  # open, then plans (or progress reports), in order
            dataset = r.choice(list(MAP_DATASETS) + list(ITERABLE_DATASETS)) if r.random() < 0.85 else self.dataset_name()
            messages = [pb.StreamRequest(open=self.open_stream(dataset)).SerializeToString()]
            for _i in range(r.choice([0, 1, 1, 2, 3])):
                messages.append(pb.StreamRequest(plan=self.plan(dataset)).SerializeToString())
            return "open+plan", messages, hold
        if pick < 0.62:  # out of order: plan first, several opens, plan after end
            dataset = r.choice(list(MAP_DATASETS))
            opening = pb.StreamRequest(open=self.open_stream(dataset)).SerializeToString()
            plan = pb.StreamRequest(plan=self.plan(dataset)).SerializeToString()
            ended = pb.StreamRequest(plan=pb.PlanBatches(batches=[pb.IndexBatch(indices=[0])], end=True)).SerializeToString()
            order = r.choice([[plan, opening], [opening, opening], [opening, plan, opening], [opening, ended, plan], [plan, plan]])
            return "out-of-order", order, hold
        if pick < 0.70:  # one message many times
            one = r.choice(
                [
                    pb.StreamRequest(open=self.open_stream()).SerializeToString(),
                    pb.StreamRequest(plan=self.plan("squares")).SerializeToString(),
                    b"",
                ]
            )
            return "duplicated", [one] * r.choice([2, 3, 10, 50]), hold
        if pick < 0.76:
            return "oneof-mixed", [self.mixed_oneof("StreamBatches") for _ in range(r.randrange(1, 3))], hold
        if pick < 0.84:
            return "garbage", [self.blob() for _ in range(r.randrange(1, 3))], hold
        if pick < 0.90:
            return "wrong-type", [self.wrong_type_message() for _ in range(r.randrange(1, 3))], hold
        if pick < 0.93:
            return "raw-wire", [self.raw_wire("StreamBatches") for _ in range(r.randrange(1, 3))], hold
        if pick < 0.97:  # open, then plans, with out-of-range varints in their integer fields
            opening = f_bytes(1, self.raw_numbers(pb.OpenStream.DESCRIPTOR))
            plans = [f_bytes(2, self.raw_numbers(pb.PlanBatches.DESCRIPTOR)) for _ in range(r.randrange(0, 3))]
            return "raw-numbers", [opening, *plans], hold
        return "no-messages", [], hold

    def extreme_stream(self) -> tuple[str, list[bytes]]:
        """A sane stream but for one extreme value: the k-th such case takes the next (field, value)
        of EXTREME_COMBOS on the next dataset, so every pair meets every dataset."""
        k = self.extremes
        self.extremes += 1
        datasets = list(MAP_DATASETS) + list(ITERABLE_DATASETS)
        dataset = datasets[k % len(datasets)]
        where, name, value = EXTREME_COMBOS[(k // len(datasets)) % len(EXTREME_COMBOS)]
        opening = pb.OpenStream(dataset=dataset, auto_collation=True, client="fuzz-extreme", protocol_revision=PROTOCOL_REVISION)
        if dataset in ITERABLE_DATASETS:
            opening.batch_size = 4
            plan = pb.PlanBatches()
        else:
            bad = {"failing": 3}.get(dataset, 1)  # the second batch fails on 'failing'
            plan = pb.PlanBatches(batches=[pb.IndexBatch(indices=[0]), pb.IndexBatch(indices=[bad])], end=True)
        if where == "open":
            setattr(opening, name, value)
        elif where == "share":
            opening.share.CopyFrom(pb.ShareSpec(name=f"extreme-{k}", epoch=value, fingerprint="fp"))
        else:
            setattr(plan, name, value)
        messages = [pb.StreamRequest(open=opening).SerializeToString(), pb.StreamRequest(plan=plan).SerializeToString()]
        return f"extreme-{name}", messages

    def session_case(self) -> tuple[str, list[bytes], bool, bool, list[bytes]]:
        """Session: (kind, messages, hold open, answer the challenge for real, messages after the proof)."""
        r = self.rng
        pick = r.random()
        hold = r.random() < 0.12

        def hello() -> bytes:
            return pb.SessionRequest(hello=pb.SessionHello(pid=r.choice(self.session_pids), protocol_revision=PROTOCOL_REVISION)).SerializeToString()

        def later() -> bytes:
            q = r.random()
            if q < 0.45:
                leases = [self.u64((1, 2, 3)) for _ in range(r.choice([0, 1, 2, 8, 100]))]
                if r.random() < 0.03:
                    leases = [r.randrange(1, 2**64)] * r.randrange(1 << 15, 1 << 17)
                return pb.SessionRequest(release=pb.SlotRelease(leases=leases)).SerializeToString()
            if q < 0.80:
                kept = [self.u64() for _ in range(r.choice([0, 1, 5]))]
                return pb.SessionRequest(abandon=pb.AbandonStream(stream_token=self.u64(), kept_leases=kept)).SerializeToString()
            if q < 0.90:
                return hello()
            return pb.SessionRequest(proof=pb.SessionProof(token=self.blob(), problem=self.text())).SerializeToString()

        if pick < 0.40:  # the handshake done right, then absurd follow-ups
            after = [later() for _ in range(r.choice([0, 1, 2, 4]))]
            return "handshake", [hello()], hold, True, after
        if pick < 0.55:  # the handshake done wrong
            bad_proof = pb.SessionRequest(
                proof=pb.SessionProof(token=r.choice([b"", self.blob(32), self.blob()]), problem=self.text())
            ).SerializeToString()
            messages = [hello(), *r.choice([[bad_proof], [hello()], [later()], [bad_proof, bad_proof], []])]
            return "bad-handshake", messages, hold, False, []
        if pick < 0.65:  # out of order: no hello first
            first = r.choice(
                [
                    pb.SessionRequest(proof=pb.SessionProof(token=self.blob(32))).SerializeToString(),
                    pb.SessionRequest(release=pb.SlotRelease(leases=[1, 2])).SerializeToString(),
                    pb.SessionRequest(abandon=pb.AbandonStream(stream_token=1)).SerializeToString(),
                    b"",
                ]
            )
            return "out-of-order", [first] + [later() for _ in range(r.randrange(0, 3))], hold, False, []
        if pick < 0.72:
            return "oneof-mixed", [self.mixed_oneof("Session") for _ in range(r.randrange(1, 3))], hold, False, []
        if pick < 0.80:
            return "garbage", [self.blob() for _ in range(r.randrange(1, 3))], hold, False, []
        if pick < 0.87:
            return "wrong-type", [self.wrong_type_message() for _ in range(r.randrange(1, 3))], hold, False, []
        if pick < 0.90:
            return "raw-wire", [self.raw_wire("Session") for _ in range(r.randrange(1, 3))], hold, False, []
        if pick < 0.93:  # a hello with an out-of-range pid, then follow-ups with out-of-range leases and tokens
            raw_hello = f_bytes(1, self.raw_numbers(pb.SessionHello.DESCRIPTOR))
            after = [self.raw_numbers(pb.SessionRequest.DESCRIPTOR) for _ in range(r.randrange(0, 3))]
            return "raw-numbers", [raw_hello], hold, True, after
        if pick < 0.96:
            return "duplicated", [hello()] * r.choice([2, 5, 20]), hold, False, []
        return "no-messages", [], hold, False, []

    def shm_scenario(self) -> dict[str, Any]:
        """A real session and a shared-memory stream on its id, with absurd releases and abandons."""
        r = self.rng
        return {
            "dataset": r.choice(["squares-big", "squares-big", "squares"]),
            "batches": r.choice([1, 2, 4, 8]),
            "window": r.choice([0, 1, 2, 4, 2**32 - 1]),
            "stream_token": self.u64((1, 7)),
            "take": r.choice([0, 1, 2, 100]),  # replies read before the releases
            "release": r.choice(["all", "twice", "none", "foreign", "extreme"]),
            "abandon": r.choice([None, "own", "other", "extreme"]),
            "end": r.choice(["finish", "cancel-stream", "cancel-session", "session-first"]),
        }

    # ------------------------------------------------------------ the sequence

    def next_case(self) -> Case:
        r = self.rng
        index = self.index
        self.index += 1
        fresh = r.random() < 0.01
        if r.random() >= self.stream_share:
            rpc = r.choice([*UNARY, "DescribeDataset", "DescribeDataset"])
            kind, body = self.unary_body(rpc)
            return Case(index, rpc, kind, [body], UNARY_TIMEOUT_S, fresh_channel=fresh)
        pick = r.random()
        if pick < 0.20:
            kind, messages = self.extreme_stream()
            # Long enough for a batch that kills its worker to be tried MAX_ATTEMPTS (3) times.
            return Case(index, "StreamBatches", kind, messages, EXTREME_TIMEOUT_S)
        if pick < 0.30:
            return Case(index, "StreamBatches", "shm-scenario", [], SCENARIO_TIMEOUT_S, scenario=self.shm_scenario())
        if pick < 0.65:
            kind, messages, hold = self.stream_messages()
            cancel = r.choice([0, 1, 3]) if r.random() < 0.08 else None
            return Case(index, "StreamBatches", kind, messages, STREAM_TIMEOUT_S, hold, cancel_after=cancel, fresh_channel=fresh)
        kind, messages, hold, real, after = self.session_case()
        cancel = r.choice([0, 1]) if r.random() < 0.05 else None
        return Case(
            index, "Session", kind, messages, STREAM_TIMEOUT_S, hold, real_proof=real, after_challenge=after,
            cancel_after=cancel, fresh_channel=fresh,
        )

    def cases(self, count: int) -> Iterator[Case]:
        for _ in range(count):
            yield self.next_case()


# ------------------------------------------------------------------ outcomes


@dataclass
class Outcome:
    """How one call ended."""

    case: Case
    rpc: str
    code: grpc.StatusCode
    details: str
    elapsed: float
    replies: list[bytes] = field(default_factory=list)
    cancelled_by_us: bool = False
    note: str = ""  # what the runner itself saw wrong (e.g. a reply that does not parse)


def check_outcome(outcome: Outcome) -> list[str]:
    """Every way ``outcome`` breaks the daemon's contract (empty: fine)."""
    problems = []
    rpc = RPCS[outcome.rpc]
    code = outcome.code
    if code not in ALLOWED_CODES:
        problems.append(f"status {code.name}")
    details = outcome.details or ""
    if len(details) > MAX_DETAILS:
        problems.append(f"error details of {len(details)} chars (limit {MAX_DETAILS})")
    if code == C.DEADLINE_EXCEEDED:
        own_deadline = outcome.case.timeout
        if outcome.elapsed < own_deadline - 0.05:
            problems.append(f"DEADLINE_EXCEEDED after {outcome.elapsed:.2f}s, before the client's {own_deadline:g}s deadline")
        elif not rpc.streaming:
            problems.append(f"a unary call got no answer within {own_deadline:g}s (the daemon stalled)")
    if outcome.note:
        problems.append(outcome.note)
    absurd = absurd_open(outcome.case)
    if absurd and not outcome.cancelled_by_us and (outcome.replies or code not in REFUSALS):
        problems.append(f"an absurd open ({absurd}) was not refused: {code.name} after {len(outcome.replies)} replies")
    if code == C.OK:
        for reply in outcome.replies:
            try:
                rpc.response.FromString(reply)
            except Exception:
                problems.append(f"a reply that does not parse as {rpc.response.__name__}: {reply[:32].hex()}")
                break
        if not rpc.streaming and len(outcome.replies) != 1:
            problems.append(f"{len(outcome.replies)} replies to a unary call")
        if not rpc.streaming:
            try:
                request = rpc.request.FromString(outcome.case.messages[0])
            except Exception:
                request = None
                problems.append(f"OK for a request that does not parse as {rpc.request.__name__}")
            if outcome.rpc == "DescribeDataset" and request is not None and request.name not in FUZZ_DATASETS:
                problems.append(f"DescribeDataset found a dataset the config does not define: {_short(request.name)}")
        if outcome.rpc == "StreamBatches" and not outcome.cancelled_by_us and len(outcome.replies) < MAX_RESPONSES:
            if not outcome.replies or _stream_kind(outcome.replies[-1]) != "end":
                problems.append("a stream ended OK without its 'end' message")
    return problems


# Quantities no real client asks for: whatever the daemon's limits are, it must refuse these.
ABSURD_STRING_BYTES = 1 << 20  # a dataset, client or share name, or a share fingerprint
ABSURD_REPLICAS = 1 << 16  # an iterable stream's num_workers
REFUSALS = frozenset({C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED, C.NOT_FOUND, C.FAILED_PRECONDITION, C.ABORTED, C.OUT_OF_RANGE})


def absurd_open(case: Case) -> str:
    """What is absurd about the 'open' a StreamBatches case starts with ('' if nothing)."""
    if case.rpc != "StreamBatches" or not case.messages:
        return ""
    try:
        first = pb.StreamRequest.FromString(case.messages[0])
    except Exception:
        return ""
    if first.WhichOneof("kind") != "open":
        return ""
    opening = first.open
    strings = {
        "dataset": opening.dataset,
        "client": opening.client,
        "share.name": opening.share.name,
        "share.fingerprint": opening.share.fingerprint,
    }
    for name, value in strings.items():
        size = len(value.encode())
        if size >= ABSURD_STRING_BYTES:
            return f"{name} of {size} bytes"
    if opening.dataset in ITERABLE_DATASETS and opening.num_workers >= ABSURD_REPLICAS:
        return f"num_workers={opening.num_workers}"
    return ""


def _stream_kind(data: bytes) -> str | None:
    """Which kind of StreamResponse ``data`` is (None if it does not parse)."""
    try:
        return pb.StreamResponse.FromString(data).WhichOneof("kind")
    except Exception:
        return None


class Tally:
    """Status codes per RPC, kinds, and every contract violation with up to a few reproducers each."""

    def __init__(self, examples: int = 3) -> None:
        self.lock = threading.Lock()
        self.codes: dict[str, Counter[str]] = {name: Counter() for name in RPCS}
        self.kinds: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)  # time spent in calls, per kind
        self.problems: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = defaultdict(list)
        self.calls = 0
        self.bytes_sent = 0
        self.max_examples = examples

    def add(self, outcome: Outcome) -> None:
        problems = check_outcome(outcome)
        with self.lock:
            self.calls += 1
            self.codes[outcome.rpc][outcome.code.name] += 1
            self.kinds[f"{outcome.rpc}:{outcome.case.kind}"] += 1
            self.seconds[f"{outcome.rpc}:{outcome.case.kind}"] += outcome.elapsed
            for problem in problems:
                key = f"{outcome.rpc}: {_problem_key(problem)}"
                self.problems[key] += 1
                if len(self.examples[key]) < self.max_examples:
                    details = _short(outcome.details, 300)
                    self.examples[key].append(f"{problem}; details={details}; {outcome.case.describe()}")

    def count_sent(self, case: Case) -> None:
        with self.lock:
            self.bytes_sent += case.bytes_sent

    def table(self) -> str:
        """The status codes per RPC, as a fixed-width table."""
        with self.lock:
            codes = sorted({c for counter in self.codes.values() for c in counter}, key=lambda c: C[c].value[0])
            header = f"{'RPC':<16}" + "".join(f"{c:>21}" for c in codes) + f"{'total':>9}"
            lines = [header]
            for name, counter in self.codes.items():
                lines.append(f"{name:<16}" + "".join(f"{counter[c]:>21}" for c in codes) + f"{sum(counter.values()):>9}")
            return "\n".join(lines)

    def problem_report(self) -> str:
        with self.lock:
            lines = []
            for key, count in self.problems.most_common():
                lines.append(f"- {key} ({count} calls)")
                lines.extend(f"    e.g. {example}" for example in self.examples[key])
            return "\n".join(lines)


def _problem_key(problem: str) -> str:
    """Problems grouped by kind (numbers dropped)."""
    if problem.startswith("error details of"):
        return "error details over the limit"
    if problem.startswith("DEADLINE_EXCEEDED after"):
        return "DEADLINE_EXCEEDED before the client's deadline"
    if problem.startswith("a reply that does not parse"):
        return "a reply that does not parse"
    if problem.startswith("DescribeDataset found"):
        return "DescribeDataset found an undefined dataset"
    if problem.startswith("an absurd open ("):
        what = problem[len("an absurd open (") :].split(" ", 1)[0].split("=", 1)[0]
        return f"an absurd open ({what}) was not refused"
    return problem


# ------------------------------------------------------------------ running


class FuzzRun:
    """Sends cases to one daemon and tallies the outcomes.

    Unary calls go out on ``concurrency`` client threads, streaming calls on
    ``stream_concurrency`` others (a stream the daemon keeps open holds its
    thread until the call's deadline, and must not hold up the unary calls)."""

    def __init__(self, address: str, concurrency: int = 8, stream_concurrency: int = 32) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.tally = Tally()
        self._unary_inbox: queue.Queue[Case | None] = queue.Queue(maxsize=2 * concurrency)
        self._stream_inbox: queue.Queue[Case | None] = queue.Queue(maxsize=2 * stream_concurrency)
        self._threads = [
            threading.Thread(target=self._work, args=(self._unary_inbox,), name=f"fuzz-unary-{i}", daemon=True)
            for i in range(concurrency)
        ] + [
            threading.Thread(target=self._work, args=(self._stream_inbox,), name=f"fuzz-stream-{i}", daemon=True)
            for i in range(stream_concurrency)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, case: Case) -> None:
        """Queue ``case`` (blocks while its threads are all busy and their queue is full)."""
        self.tally.count_sent(case)
        target = self._stream_inbox if RPCS[case.rpc].streaming else self._unary_inbox
        target.put(case, timeout=600)

    def drain(self, timeout: float = 120.0) -> None:
        """Wait until every queued case has been answered."""
        deadline = time.monotonic() + timeout
        while self._unary_inbox.unfinished_tasks or self._stream_inbox.unfinished_tasks:
            if time.monotonic() > deadline:
                raise AssertionError(f"fuzz calls still unanswered after {timeout:g}s")
            time.sleep(0.01)

    def close(self) -> None:
        for thread in self._threads:
            (self._stream_inbox if "stream" in thread.name else self._unary_inbox).put(None, timeout=60)
        for thread in self._threads:
            thread.join(60)
        self.channel.close()

    def _work(self, inbox: queue.Queue[Case | None]) -> None:
        while True:
            try:
                case = inbox.get(timeout=3600)  # close() sends None; a forgotten run ends on its own
            except queue.Empty:
                return
            if case is None:
                inbox.task_done()
                return
            try:
                for outcome in self.run_case(case):
                    self.tally.add(outcome)
            except Exception as exc:
                self.tally.add(Outcome(case, case.rpc, C.UNKNOWN, "", 0.0, note=f"fuzz runner error: {exc!r}"))
            finally:
                inbox.task_done()

    # ------------------------------------------------------------ one call

    def run_case(self, case: Case) -> list[Outcome]:
        channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS) if case.fresh_channel else self.channel
        try:
            if case.scenario is not None:
                return self._shm_scenario(channel, case)
            if RPCS[case.rpc].streaming:
                return [self._streaming(channel, case)]
            return [self._unary(channel, case)]
        finally:
            if case.fresh_channel:
                channel.close()

    def _unary(self, channel: grpc.Channel, case: Case) -> Outcome:
        call = channel.unary_unary(RPCS[case.rpc].path, request_serializer=None, response_deserializer=None)
        t0 = time.monotonic()
        try:
            reply = call(case.messages[0], timeout=case.timeout)
            return Outcome(case, case.rpc, C.OK, "", time.monotonic() - t0, [reply])
        except grpc.RpcError as exc:
            return Outcome(case, case.rpc, exc.code(), exc.details() or "", time.monotonic() - t0)

    def _streaming(self, channel: grpc.Channel, case: Case) -> Outcome:
        outbox: queue.Queue[bytes | None] = queue.Queue()
        for message in case.messages:
            outbox.put(message)
        if not case.hold_open and not case.real_proof:
            outbox.put(None)
        call = channel.stream_stream(RPCS[case.rpc].path, request_serializer=None, response_deserializer=None)
        t0 = time.monotonic()
        responses = call(_requests(outbox, case.timeout + 10), timeout=case.timeout)
        responses.add_done_callback(lambda _: outbox.put(None))
        replies: list[bytes] = []
        cancelled = False
        note = ""
        if case.cancel_after == 0:
            cancelled = True
            responses.cancel()
        try:
            for reply in responses:
                replies.append(reply)
                if case.real_proof and len(replies) == 1:
                    note = _answer_challenge(reply, outbox)
                    for message in case.after_challenge:
                        outbox.put(message)
                    if not case.hold_open:
                        outbox.put(None)
                if (case.cancel_after is not None and len(replies) >= case.cancel_after) or len(replies) >= MAX_RESPONSES:
                    cancelled = True
                    responses.cancel()
                    break
            code, details = (C.CANCELLED, "cancelled by the client") if cancelled else (C.OK, "")
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        return Outcome(case, case.rpc, code, details, time.monotonic() - t0, replies, cancelled, note)

    def _shm_scenario(self, channel: grpc.Channel, case: Case) -> list[Outcome]:
        """A real session and a stream on its id; absurd releases and abandons; then an ending."""
        s = case.scenario or {}
        deadline = SCENARIO_TIMEOUT_S
        session_out: queue.Queue[bytes | None] = queue.Queue()
        session_out.put(pb.SessionRequest(hello=pb.SessionHello(pid=os.getpid(), protocol_revision=PROTOCOL_REVISION)).SerializeToString())
        session = channel.stream_stream(RPCS["Session"].path, request_serializer=None, response_deserializer=None)
        t0 = time.monotonic()
        session_call = session(_requests(session_out, deadline + 10), timeout=deadline)
        session_call.add_done_callback(lambda _: session_out.put(None))
        outcomes: list[Outcome] = []
        session_replies: list[bytes] = []
        session_id = 0
        note = ""
        try:
            for reply in session_call:
                session_replies.append(reply)
                parsed = pb.SessionResponse.FromString(reply)
                if parsed.WhichOneof("kind") == "challenge":
                    note = _answer_challenge(reply, session_out)
                elif parsed.WhichOneof("kind") == "ready":
                    session_id = parsed.ready.session_id
                    break
        except grpc.RpcError as exc:
            outcomes.append(Outcome(case, "Session", exc.code(), exc.details() or "", time.monotonic() - t0, session_replies, note=note))
            return outcomes
        except Exception as exc:
            note = f"session reply does not parse: {exc!r}"

        dataset = s["dataset"]
        n = MAP_DATASETS[dataset]
        size = BIG_BATCH if dataset == "squares-big" else 8
        opening = pb.OpenStream(
            dataset=dataset,
            auto_collation=True,
            window=s["window"],
            session_id=session_id,
            stream_token=s["stream_token"],
            client="fuzz-shm",
            protocol_revision=PROTOCOL_REVISION,
        )
        plan = pb.PlanBatches(
            batches=[pb.IndexBatch(indices=range(i * size % n, i * size % n + size)) for i in range(s["batches"])],
            end=True,
        )
        stream_out: queue.Queue[bytes | None] = queue.Queue()
        stream_out.put(pb.StreamRequest(open=opening).SerializeToString())
        stream_out.put(pb.StreamRequest(plan=plan).SerializeToString())
        stream = channel.stream_stream(RPCS["StreamBatches"].path, request_serializer=None, response_deserializer=None)
        t1 = time.monotonic()
        stream_call = stream(_requests(stream_out, deadline + 10), timeout=deadline)
        stream_call.add_done_callback(lambda _: stream_out.put(None))
        stream_replies: list[bytes] = []
        leases: list[int] = []
        stream_code, stream_details, stream_cancelled = C.OK, "", False

        def release(ids: list[int]) -> None:
            session_out.put(pb.SessionRequest(release=pb.SlotRelease(leases=ids)).SerializeToString())

        try:
            for reply in stream_call:
                stream_replies.append(reply)
                parsed = pb.StreamResponse.FromString(reply)
                if parsed.WhichOneof("kind") == "batch" and parsed.batch.HasField("slot"):
                    leases.append(parsed.batch.slot.lease)
                if len(stream_replies) == s["take"]:
                    break
        except grpc.RpcError as exc:
            stream_code, stream_details = exc.code(), exc.details() or ""

        mode = s["release"]
        if mode in ("all", "twice"):
            release(leases)
            if mode == "twice":
                release(leases + leases)
        elif mode == "foreign":
            release([lease + 1_000_000 for lease in leases] + [0])
        elif mode == "extreme":
            release([2**64 - 1, 2**63, 0, 1])
        abandon = s["abandon"]
        if abandon is not None:
            token = {"own": s["stream_token"], "other": s["stream_token"] ^ 1, "extreme": 2**64 - 1}[abandon]
            kept = leases[:1] if abandon == "own" else [2**64 - 1]
            session_out.put(pb.SessionRequest(abandon=pb.AbandonStream(stream_token=token, kept_leases=kept)).SerializeToString())

        end = s["end"]
        if end == "session-first":
            session_out.put(None)
        if stream_code == C.OK and len(stream_replies) == s["take"]:
            if end in ("cancel-stream", "cancel-session"):
                stream_cancelled = True
                stream_call.cancel()
                stream_code, stream_details = C.CANCELLED, "cancelled by the client"
            else:
                try:
                    for reply in stream_call:
                        stream_replies.append(reply)
                        parsed = pb.StreamResponse.FromString(reply)
                        if parsed.WhichOneof("kind") == "batch" and parsed.batch.HasField("slot"):
                            release([parsed.batch.slot.lease])
                except grpc.RpcError as exc:
                    stream_code, stream_details = exc.code(), exc.details() or ""
        outcomes.append(
            Outcome(case, "StreamBatches", stream_code, stream_details, time.monotonic() - t1, stream_replies, stream_cancelled)
        )
        session_cancelled = False
        if end == "cancel-session":
            session_cancelled = True
            session_call.cancel()
        session_out.put(None)
        session_code, session_details = C.OK, ""
        try:
            for reply in session_call:  # retired notices, then the end of the call
                session_replies.append(reply)
        except grpc.RpcError as exc:
            session_code, session_details = exc.code(), exc.details() or ""
        if session_cancelled and session_code == C.OK:
            session_code, session_details = C.CANCELLED, "cancelled by the client"
        outcomes.append(
            Outcome(case, "Session", session_code, session_details, time.monotonic() - t0, session_replies, session_cancelled, note)
        )
        return outcomes


def _requests(outbox: queue.Queue[bytes | None], timeout: float) -> Iterator[bytes]:
    """The request side of a streaming call: what ``outbox`` holds, until None (half-close)."""
    while True:
        try:
            message = outbox.get(timeout=timeout)
        except queue.Empty:
            return
        if message is None:
            return
        yield message


def _answer_challenge(reply: bytes, outbox: queue.Queue[bytes | None]) -> str:
    """Send the proof a real client would: the bytes of the challenge file. A problem, or ''."""
    try:
        response = pb.SessionResponse.FromString(reply)
    except Exception:
        return "the first Session reply does not parse"
    if response.WhichOneof("kind") != "challenge":
        return ""
    path = response.challenge.path
    token, problem = b"", ""
    if not (path.startswith("/dev/shm/loaderd-") and "/" not in path[len("/dev/shm/") :]):
        problem = f"challenge path outside /dev/shm/loaderd-*: {_short(path)}"
    else:
        try:
            with open(path, "rb") as f:
                token = f.read(64)
        except OSError as exc:
            problem = f"cannot read the challenge file: {exc.strerror}"
    outbox.put(pb.SessionRequest(proof=pb.SessionProof(token=token, problem=problem)).SerializeToString())
    return "" if not problem else f"session challenge: {problem}"


# ------------------------------------------------------------------ the daemon's footprint


@dataclass(frozen=True)
class ProcStats:
    """A process's open file descriptors, threads and resident memory (VmRSS, and its anonymous part)."""

    fds: int
    threads: int
    rss_kb: int
    anon_kb: int = 0

    @classmethod
    def read(cls, pid: int) -> ProcStats:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        fields = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = value.strip()
        return cls(
            fds=fds,
            threads=int(fields["Threads"]),
            rss_kb=int(fields["VmRSS"].split()[0]),
            anon_kb=int(fields.get("RssAnon", "0 kB").split()[0]),
        )

    def __str__(self) -> str:
        return f"fds={self.fds} threads={self.threads} rss={self.rss_kb / 1024:.1f}MB (anon {self.anon_kb / 1024:.1f}MB)"


def footprint_problems(baseline: ProcStats, now: ProcStats) -> list[str]:
    """Why the daemon's footprint ``now`` is not back near ``baseline`` (the bounds above); none when it is."""
    problems = []
    if now.fds > baseline.fds + FD_MARGIN or now.threads > baseline.threads + THREAD_MARGIN:
        problems.append(f"fds/threads did not come back within {FOOTPRINT_SETTLE_S:g} s: warm-up {baseline}, now {now}")
    if now.rss_kb - baseline.rss_kb >= RSS_GROWTH_KB:
        problems.append(
            f"RSS grew {(now.rss_kb - baseline.rss_kb) / 1024:.1f} MB after the warm-up (bound {RSS_GROWTH_KB // 1024} MB, "
            f"{FOOTPRINT_SETTLE_S:g} s to settle): warm-up {baseline}, now {now}"
        )
    return problems


def come_back(pid: int, baseline: ProcStats) -> tuple[ProcStats, list[str]]:
    """Wait up to FOOTPRINT_SETTLE_S for the daemon's footprint to come back near ``baseline``:
    its stats then, and what did not come back (empty once it did)."""
    deadline = time.monotonic() + FOOTPRINT_SETTLE_S
    while True:
        now = ProcStats.read(pid)
        problems = footprint_problems(baseline, now)
        if not problems or time.monotonic() > deadline:
            return now, problems
        time.sleep(0.2)


def shm_entries(pid: int) -> list[str]:
    """The daemon's files in /dev/shm (segments and session probes): ``loaderd-<pid>-*``."""
    try:
        return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"loaderd-{pid}-"))
    except FileNotFoundError:
        return []


def daemon_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


# ------------------------------------------------------------------ after the run


def check_epochs(address: str, seed: int, timeout: float = 30.0) -> list[str]:
    """A shuffled epoch (default transport) and a shared-memory epoch of big batches: each must equal torch's.

    Returns what went wrong (empty: both matched batch for batch)."""
    import torch

    from loaderd import RemoteDataLoader
    from support import datasets
    from support.compare import assert_same_batches
    from support.daemons import oracle_loader

    problems = []
    runs: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        (
            f"squares shuffled (generator seed {seed})",
            lambda: RemoteDataLoader(
                "squares", batch_size=7, shuffle=True, generator=torch.Generator().manual_seed(seed), address=address, timeout=timeout
            ),
            lambda: oracle_loader(datasets.Squares(SQUARES_N), batch_size=7, shuffle=True, generator=torch.Generator().manual_seed(seed)),
        ),
        (
            "squares-big over shared memory",
            lambda: RemoteDataLoader("squares-big", batch_size=BIG_BATCH, address=address, transport="shm", timeout=timeout),
            lambda: oracle_loader(datasets.Squares(BIG_N), batch_size=BIG_BATCH),
        ),
    ]
    for name, remote, local in runs:
        try:
            got = list(remote())
            want = list(local())
            assert len(got) == len(want), f"{len(got)} batches, torch gives {len(want)}"
            assert_same_batches(got, want)
        except Exception as exc:
            problems.append(f"post-fuzz epoch {name}: {type(exc).__name__}: {str(exc)[:500]}")
    return problems


def health_serving(address: str, timeout: float = 5.0) -> str:
    """'' if the daemon's health service says SERVING, else what it said."""
    from grpc_health.v1 import health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.RpcError as exc:
        return f"health check failed: {exc.code().name} {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return ""


def log_findings(log: str, context: int = 30) -> list[str]:
    """Tracebacks and dead threads in the daemon's log (a handler or the scheduler raised): one entry per
    distinct error, the rarest first, each with its count and the full text of its first occurrence."""
    found: dict[str, list[Any]] = {}
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if not (line.startswith("Traceback") or "Exception in thread" in line):
            continue
        if line.startswith("Traceback") and i and "Exception in thread" in lines[i - 1]:
            continue  # counted at the "Exception in thread" line
        end = next((j for j in range(i + 1, min(i + 400, len(lines))) if lines[j] and not lines[j].startswith(" ") and not lines[j].startswith("Traceback") and not lines[j].startswith("During handling") and not lines[j].startswith("The above exception")), i)
        head = lines[i - 1] if line.startswith("Traceback") and i else line
        head = re.sub(r"^\d{4}-\d\d-\d\d [\d:,.]+ ", "", head.strip())  # the timestamp
        key = f"{head[:200]} ... {lines[end].strip()[:300]}"
        if key not in found:
            text = "\n".join(f"      | {text[:300]}" for text in lines[max(0, i - 1) : end + 1][-context:])
            found[key] = [0, text]
        found[key][0] += 1
    ordered = sorted(found.items(), key=lambda item: item[1][0])
    return [f"{key} ({count} times); first:\n{text}" for key, (count, text) in ordered]


def cap_address_space(pid: int, headroom: int = 3 << 30) -> int:
    """Limit the daemon's address space to what it maps now plus ``headroom``; returns the limit.

    A guard for the machine, not a check: a request the daemon would answer by
    allocating without bound (an iterable stream with num_workers=2**32-1 builds
    one cursor per replica) then fails with MemoryError inside the daemon, which
    the fuzz reports, instead of pulling tens of GB from everything else here.
    The headroom covers a few hundred more thread stacks (8 MiB of address space each)."""
    import resource

    vm_size = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            vm_size = int(line.split()[1]) * 1024
    limit = vm_size + headroom
    resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))
    return limit


def stray_probes(address: str, entries: list[str]) -> list[str]:
    """Session challenge files beyond one per open (or paused) session: each session keeps its own while it lives."""
    probes = [name for name in entries if "probe" in name]
    calls = open_calls(address)
    return probes if calls is None or len(probes) > calls[1] else []


def open_calls(address: str, timeout: float = 10.0) -> tuple[int, int] | None:
    """(open streams, open sessions) as the daemon's Status RPC reports them; None if it does not answer."""
    from loaderd.v1 import loaderd_pb2_grpc

    try:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            status = loaderd_pb2_grpc.LoaderStub(channel).Status(pb.StatusRequest(), timeout=timeout)
    except grpc.RpcError:
        return None
    return len(status.streams), status.sessions
