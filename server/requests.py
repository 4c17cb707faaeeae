"""A client's stream requests, checked and put in the daemon's terms.

``open_spec`` turns an ``OpenStream`` into a ``StreamSpec`` (and the shared job
it joins); ``plan_batches`` turns each later ``PlanBatches`` into index batches.
Each raises ``BadRequestError`` with a message that names the problem; the
servicer maps it to INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass

from loaderd.server.catalog import Catalog
from loaderd.server.share import ShareKey
from loaderd.server.stream import BatchStream, StreamSpec
from loaderd.server.tasks import Indices
from loaderd.v1 import loaderd_pb2 as pb

# Upper bound on indices in one plan batch: keeps a malformed request from making a worker allocate without bound.
MAX_BATCH_INDICES = 1 << 24
# A stream's default window is this many batches per worker that can serve it.
DEFAULT_WINDOW_PER_WORKER = 4


class BadRequestError(ValueError):
    """A stream request the daemon cannot serve; the message says why."""


@dataclass(frozen=True)
class Opening:
    """A checked ``OpenStream``: the stream to open and the share it joins (None: its own)."""

    spec: StreamSpec
    share: ShareKey | None


def open_spec(request: pb.OpenStream, catalog: Catalog, max_window: int, *, peer: str, shm: bool) -> Opening:
    """Check an ``OpenStream``; UnknownDatasetError or BadRequestError if it cannot be served."""
    if not request.auto_collation and request.batch_size:
        raise BadRequestError("batch_size must be 0 without automatic batching")
    meta = catalog.lookup(request.dataset)
    replicas = max(1, request.num_workers) if meta.iterable else catalog.pool_size
    window = min(request.window or DEFAULT_WINDOW_PER_WORKER * replicas, max_window)
    share = None
    if request.HasField("share"):
        if meta.iterable:
            raise BadRequestError(f"dataset {request.dataset!r} is an IterableDataset: shares serve map-style datasets")
        if not request.share.name:
            raise BadRequestError("a share needs a name")
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
        stream_token=request.stream_token,
        shm=shm,
        share=share.name if share is not None else None,
    )
    return Opening(spec, share)


def plan_batches(request: pb.StreamRequest, stream: BatchStream) -> tuple[list[Indices], pb.PlanBatches]:
    """The index batches a plan request adds to ``stream`` (none for an iterable stream's progress report)."""
    if request.WhichOneof("kind") != "plan":
        raise BadRequestError("after 'open', a stream carries only 'plan' requests")
    plan = request.plan
    spec = stream.spec
    if spec.iterable:
        if plan.batches or plan.end:
            raise BadRequestError(f"dataset {spec.dataset!r} is an IterableDataset: it takes no index plan")
        return [], plan
    if stream.plan_end:
        raise BadRequestError("plan received after the plan's end")
    for i, batch in enumerate(plan.batches):
        n = len(batch.indices)
        if spec.auto_collation and not 0 < n <= MAX_BATCH_INDICES:
            raise BadRequestError(f"plan batch {stream.planned + i} has {n} indices")
        if not spec.auto_collation and n != 1:
            raise BadRequestError(
                f"plan item {stream.planned + i} must hold exactly one index without automatic batching, got {n}"
            )
    if spec.auto_collation:
        return [tuple(b.indices) for b in plan.batches], plan
    return [b.indices[0] for b in plan.batches], plan
