"""loaderd.wire.reasons: a failed call's reason crosses as a google.rpc.ErrorInfo, and the client maps it."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from loaderd.channel.rpc_errors import error_from_rpc
from loaderd.errors import DatasetNotFoundError, LimitExceededError
from loaderd.wire.reasons import Reason, reason_of, status_with_reason


class _FailedCall(grpc.RpcError, grpc.Call):
    """What a client holds after a call the daemon ended with ``status`` (grpc's own failed-call shape)."""

    def __init__(self, status: Any, metadata: tuple[tuple[str, Any], ...] | None = None) -> None:
        self._status = status
        self._metadata = status.trailing_metadata if metadata is None else metadata

    def code(self) -> grpc.StatusCode:
        return self._status.code

    def details(self) -> str:
        return self._status.details

    def trailing_metadata(self) -> Any:
        return self._metadata

    def initial_metadata(self) -> Any:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_survives_the_trip(reason: Reason) -> None:
    status = status_with_reason(grpc.StatusCode.RESOURCE_EXHAUSTED, "over", reason)
    assert (status.code, status.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "over")
    assert reason_of(_FailedCall(status)) is reason


def test_a_call_without_details_has_no_reason() -> None:
    status = status_with_reason(grpc.StatusCode.NOT_FOUND, "no such dataset", Reason.UNKNOWN_DATASET)
    failed = _FailedCall(status, metadata=())
    assert reason_of(failed) is None
    assert isinstance(error_from_rpc(failed, "here"), DatasetNotFoundError)  # the code still says what it is
    # gRPC's own cap on concurrent calls (maximum_concurrent_rpcs) attaches no reason: calls open, like admission.
    capped = _FailedCall(status_with_reason(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!", Reason.INTERNAL), metadata=())
    error = error_from_rpc(capped, "here")
    assert isinstance(error, LimitExceededError) and error.admission


def test_the_message_travels_once() -> None:
    """grpc-message carries it; the details trailer holds the reason alone (a long message would count twice)."""
    status = status_with_reason(grpc.StatusCode.NOT_FOUND, "x" * 5000, Reason.UNKNOWN_DATASET)
    ((key, value),) = status.trailing_metadata
    assert key == "grpc-status-details-bin" and len(value) < 100 and status.details == "x" * 5000


@pytest.mark.parametrize(("reason", "admission"), [(Reason.ADMISSION_LIMIT, True), (Reason.REQUEST_LIMIT, False)])
def test_a_limit_says_whether_another_daemon_may_take_the_call(reason: Reason, admission: bool) -> None:
    status = status_with_reason(grpc.StatusCode.RESOURCE_EXHAUSTED, "the daemon has 4 streams open", reason)
    error = error_from_rpc(_FailedCall(status), "here")
    assert isinstance(error, LimitExceededError) and error.admission is admission
    assert str(error) == "the daemon has 4 streams open"
