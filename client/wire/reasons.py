"""Why a daemon refused or ended a call, as structured details both sides read.

The daemon ends a failed call with its gRPC status and message (for people) and a
``google.rpc.ErrorInfo`` in the status details (domain ``loaderd``, reason one of ``Reason``),
carried in the ``grpc-status-details-bin`` trailer as gRPC defines it (the protos from
googleapis-common-protos; grpcio-status reads it too). The client decides what a
failure means from the reason, never from the message's text; a call that failed before any
daemon answered (a connection refused, a TLS handshake) has none.

The protos are imported on first use: a failure, not every process that
imports this layer.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple, NoReturn

DOMAIN = "loaderd"


class Reason(enum.Enum):
    """What the daemon said a failed call failed for."""

    UNKNOWN_DATASET = "UNKNOWN_DATASET"  # the daemon's config has no such dataset
    BAD_REQUEST = "BAD_REQUEST"  # malformed or out of range: no daemon would take it
    SHARE_MISMATCH = "SHARE_MISMATCH"  # the loader's plan contradicts its share's
    ADMISSION_LIMIT = "ADMISSION_LIMIT"  # the daemon has as many calls as its limits allow: another may take it
    REQUEST_LIMIT = "REQUEST_LIMIT"  # the request itself is over a limit: every daemon refuses it alike
    UNKNOWN_SESSION = "UNKNOWN_SESSION"  # a session the daemon does not know (it restarted): open a new one
    DRAINING = "DRAINING"  # the daemon is stopping and sends clients elsewhere
    UNAVAILABLE = "UNAVAILABLE"  # the daemon cannot serve the call now (stopping, no worker can run it)
    INTERNAL = "INTERNAL"  # the daemon failed handling the call: its own bug
    UNAUTHENTICATED = "UNAUTHENTICATED"  # no or a wrong bearer token
    REVISION_MISMATCH = "REVISION_MISMATCH"  # the client speaks another protocol revision than the daemon


# The trailer gRPC defines for a google.rpc.Status, the details of a failed call.
STATUS_TRAILER = "grpc-status-details-bin"


class _Status(NamedTuple):
    """A ``grpc.Status`` for ``abort_with_status`` (grpc.Status is an interface of these three attributes)."""

    code: Any
    details: str
    trailing_metadata: tuple[tuple[str, bytes], ...]


def status_with_reason(code: Any, message: str, reason: Reason) -> Any:
    """A ``grpc.Status`` for ``context.abort_with_status``: ``code`` (a grpc.StatusCode), ``message``
    and, in the details trailer, a google.rpc.Status whose ErrorInfo names ``reason``. The message is
    not repeated there (grpc-message carries it): a long one would count twice against the
    client's limit on metadata."""
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2

    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason.value, domain=DOMAIN))
    status = status_pb2.Status(code=code.value[0], details=[detail])
    return _Status(code, message, ((STATUS_TRAILER, status.SerializeToString()),))


def reason_of(exc: Any) -> Reason | None:
    """The reason a daemon gave for the failed call ``exc`` (a grpc.RpcError), if it gave one."""
    from google.protobuf.message import DecodeError
    from google.rpc import error_details_pb2, status_pb2

    trailer = getattr(exc, "trailing_metadata", None)
    metadata = trailer() if callable(trailer) else None
    raw = next((value for key, value in metadata or () if key == STATUS_TRAILER), None)
    if not isinstance(raw, bytes):
        return None
    status = status_pb2.Status()
    try:
        status.ParseFromString(raw)
    except DecodeError:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                try:
                    return Reason(info.reason)
                except ValueError:  # a newer daemon's reason: the status code still says enough
                    return None
    return None


def abort(context: Any, code: Any, message: str, reason: Reason) -> NoReturn:
    """End the call behind ``context`` (a grpc.ServicerContext) with ``code``, ``message`` and ``reason``."""
    context.abort_with_status(status_with_reason(code, message, reason))
    raise AssertionError("unreachable: abort_with_status raises")
