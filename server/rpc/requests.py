"""A client's stream requests, checked and put in the daemon's terms.

``open_spec`` turns an ``OpenStream`` into a ``StreamSpec`` (and the shared job
it joins); ``plan_batches`` turns each later ``PlanBatches`` into index batches.
Every number a client sends is range-checked here: nonsense raises
``BadRequestError`` (INVALID_ARGUMENT), a client of another protocol revision
``RevisionMismatchError`` (FAILED_PRECONDITION); a quantity over one of the config's
``limits`` raises ``LimitExceededError`` (RESOURCE_EXHAUSTED). Both name the
field and the bound, never echo more than a few characters of what was sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from loaderd.errors import LimitExceededError, clip
from loaderd.server.config.schema import Limits
from loaderd.server.scheduling.catalog import Catalog
from loaderd.server.scheduling.share import ShareKey
from loaderd.server.scheduling.stream import BatchStream, StreamSpec
from loaderd.server.worker.tasks import Indices
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.limits import PROTOCOL_REVISION, revision_mismatch

# Upper bound on indices in one plan batch: keeps a malformed request from making a worker allocate without bound.
MAX_BATCH_INDICES = 1 << 24
# A stream's default window is this many batches per worker that can serve it.
DEFAULT_WINDOW_PER_WORKER = 4
# Batch positions (start, consumed) past this are nonsense: 2**48 batches is ~9,000 years at 1M batches/s.
MAX_POSITION = 1 << 48


class BadRequestError(ValueError):
    """A stream request the daemon cannot serve; the message says why."""


class RevisionMismatchError(ValueError):
    """The client speaks another protocol revision than this daemon; the message names both."""


def check_revision(theirs: int) -> None:
    """RevisionMismatchError unless a client's ``protocol_revision`` (OpenStream, SessionHello) is this daemon's."""
    if theirs != PROTOCOL_REVISION:
        older = " (0: a client from before revision 6, which names none)" if theirs == 0 else ""
        raise RevisionMismatchError(f"the client {revision_mismatch(theirs, 'daemon')}{older}")


@dataclass(frozen=True)
class PlanItems:
    """A checked ``PlanBatches``: index batches to add, and (a positioned stream) their epoch positions."""

    batches: list[Indices]
    positions: list[int] | None
    plan: pb.PlanBatches


@dataclass(frozen=True)
class Opening:
    """A checked ``OpenStream``: the stream to open and the share it joins (None: its own)."""

    spec: StreamSpec
    share: ShareKey | None


def shown(text: str) -> str:
    """A client-sent string as it appears in errors and logs: quoted, bounded."""
    return repr(clip(text, 80))


def check_name(value: str, field: str, limits: Limits) -> str:
    """A client-sent name, LimitExceededError if longer than ``limits.max_name_bytes``."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > limits.max_name_bytes:
        raise LimitExceededError(f"{field} is {size} bytes long; the daemon's limit (limits.max_name_bytes) is {limits.max_name_bytes}")
    return value


def check_position(value: int, field: str) -> int:
    if value >= MAX_POSITION:
        raise BadRequestError(f"{field} = {value} is out of range (at most {MAX_POSITION - 1})")
    return value


def open_spec(
    request: pb.OpenStream, catalog: Catalog, limits: Limits, max_window: int, *, peer: str, session_id: int = 0, identity: str = ""
) -> Opening:
    """Check an ``OpenStream``; UnknownDatasetError, BadRequestError or LimitExceededError if it cannot be served.

    ``session_id``: the caller's verified shared-memory session (0: none; ``request.session_id`` is
    only what the client claims)."""
    check_revision(request.protocol_revision)
    check_name(request.dataset, "the dataset name", limits)
    check_name(request.client, "the client name", limits)
    check_position(request.start, "start")
    if not request.auto_collation and request.batch_size:
        raise BadRequestError("batch_size must be 0 without automatic batching")
    if request.batch_size > MAX_BATCH_INDICES:
        raise BadRequestError(f"batch_size = {request.batch_size} is out of range (at most {MAX_BATCH_INDICES})")
    meta = catalog.lookup(request.dataset)
    if meta.iterable and request.num_workers > limits.max_replicas:
        raise LimitExceededError(
            f"num_workers = {request.num_workers}: an iterable stream may have at most "
            f"{limits.max_replicas} replicas (limits.max_replicas)"
        )
    replicas = max(1, request.num_workers) if meta.iterable else catalog.pool_size
    window = min(request.window or DEFAULT_WINDOW_PER_WORKER * replicas, max_window)
    if request.positioned and (meta.iterable or request.HasField("share") or request.start):
        raise BadRequestError("a positioned stream serves a map-style dataset, without a share or a start")
    share = None
    if request.HasField("share"):
        if meta.iterable:
            raise BadRequestError(f"dataset {request.dataset!r} is an IterableDataset: shares serve map-style datasets")
        if not request.share.name:
            raise BadRequestError("a share needs a name")
        check_name(request.share.name, "the share name", limits)
        check_name(request.share.fingerprint, "the share fingerprint", limits)
        share = ShareKey(
            name=request.share.name,
            epoch=request.share.epoch,
            dataset=request.dataset,
            fingerprint=request.share.fingerprint,
            auto_collation=request.auto_collation,
            base_seed=request.base_seed,
        )
    spec = StreamSpec(
        dataset=request.dataset,
        iterable=meta.iterable,
        auto_collation=request.auto_collation,
        batch_size=request.batch_size,
        drop_last=request.drop_last,
        num_workers=request.num_workers,
        base_seed=request.base_seed,
        window=max(1, window),
        start=request.start,
        client=request.client,
        peer=peer,
        identity=identity,
        stream_token=request.stream_token,
        session_id=session_id,
        share=share.name if share is not None else None,
        positioned=request.positioned,
    )
    return Opening(spec, share)


def plan_batches(request: pb.StreamRequest, stream: BatchStream, limits: Limits) -> PlanItems:
    """The index batches a plan request adds to ``stream`` (none for a progress report: no batches, no end).

    Reads the stream's counters: call with the scheduler's lock held, or accept
    that a concurrent delivery makes the limits a little looser (never tighter).
    """
    if request.WhichOneof("kind") != "plan":
        raise BadRequestError("after 'open', a stream carries only 'plan' requests")
    plan = request.plan
    spec = stream.spec
    check_position(plan.consumed, "consumed")
    if spec.iterable:
        if plan.batches or plan.end:
            raise BadRequestError(f"dataset {spec.dataset!r} is an IterableDataset: it takes no index plan")
        return PlanItems([], None, plan)
    if not plan.batches and not plan.end:
        # Progress only (the client's CONSUMED and wait; protocol revision 6): taken after the plan's end too.
        return PlanItems([], [] if spec.positioned else None, plan)
    if stream.plan_end:
        raise BadRequestError("plan received after the plan's end")
    ahead = stream.planned + len(plan.batches) - max(stream.consumed, plan.consumed)
    if ahead > limits.max_plan_ahead:
        raise LimitExceededError(
            f"the plan runs {ahead} batches ahead of what the client consumed; "
            f"the daemon's limit (limits.max_plan_ahead) is {limits.max_plan_ahead}"
        )
    indices = stream.pending_indices
    for i, batch in enumerate(plan.batches):
        n = len(batch.indices)
        indices += n
        if spec.auto_collation and not 0 < n <= MAX_BATCH_INDICES:
            raise BadRequestError(f"plan batch {stream.planned + i} has {n} indices")
        if not spec.auto_collation and n != 1:
            raise BadRequestError(
                f"plan item {stream.planned + i} must hold exactly one index without automatic batching, got {n}"
            )
        if spec.positioned:
            check_position(batch.position, f"plan batch {stream.planned + i}'s position")
        elif batch.position:
            raise BadRequestError(f"plan batch {stream.planned + i} has a position on a stream that was not opened positioned")
    if indices > limits.max_plan_indices:
        raise LimitExceededError(
            f"the plan holds {indices} indices not yet dispatched; "
            f"the daemon's limit per stream (limits.max_plan_indices) is {limits.max_plan_indices}"
        )
    positions = [b.position for b in plan.batches] if spec.positioned else None
    if spec.auto_collation:
        return PlanItems([tuple(b.indices) for b in plan.batches], positions, plan)
    return PlanItems([b.indices[0] for b in plan.batches], positions, plan)
