"""How the daemon's refusals and stream failures reach a client: the gRPC status code and loaderd reason for each,
in one table each (the servicer aborts with them; the client maps reasons back: loaderd.channel.rpc_errors)."""

from __future__ import annotations

import grpc

from loaderd.errors import LimitExceededError
from loaderd.server.rpc.admission import AdmissionRefused
from loaderd.server.rpc.requests import BadRequestError, RevisionMismatchError
from loaderd.server.scheduling.catalog import UnknownDatasetError
from loaderd.server.scheduling.producer import FailReason
from loaderd.server.scheduling.share import ShareMismatchError
from loaderd.wire.reasons import Reason

# Why a request is refused -> the status code and reason the client sees (the first class that matches).
REFUSALS: dict[type[Exception], tuple[grpc.StatusCode, Reason]] = {
    UnknownDatasetError: (grpc.StatusCode.NOT_FOUND, Reason.UNKNOWN_DATASET),
    BadRequestError: (grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_REQUEST),
    RevisionMismatchError: (grpc.StatusCode.FAILED_PRECONDITION, Reason.REVISION_MISMATCH),
    ShareMismatchError: (grpc.StatusCode.FAILED_PRECONDITION, Reason.SHARE_MISMATCH),
    AdmissionRefused: (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.ADMISSION_LIMIT),
    LimitExceededError: (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.REQUEST_LIMIT),
}
REFUSED = tuple(REFUSALS)

# Why a stream failed (the daemon's reason) -> the status code and reason the client sees.
FAILURES: dict[FailReason, tuple[grpc.StatusCode, Reason]] = {
    FailReason.UNAVAILABLE: (grpc.StatusCode.UNAVAILABLE, Reason.UNAVAILABLE),
    FailReason.INTERNAL: (grpc.StatusCode.INTERNAL, Reason.INTERNAL),
    FailReason.INVALID: (grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_REQUEST),
    FailReason.MISMATCH: (grpc.StatusCode.FAILED_PRECONDITION, Reason.SHARE_MISMATCH),
    FailReason.LIMIT: (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.REQUEST_LIMIT),
}


def refusal(exc: Exception) -> tuple[grpc.StatusCode, Reason]:
    """The status code and reason for a refusal ``exc`` (one of ``REFUSED``)."""
    return next(refusal for kind, refusal in REFUSALS.items() if isinstance(exc, kind))
