"""AdmittedHealth: gRPC's standard health service, its ``Watch`` calls admitted like the daemon's own.

A ``Watch`` lasts as long as its caller wants and holds a handler thread all
that time (``add_parsing`` registers it in the blocking style), so an
unbounded number of them would take every thread and every call the server
admits. Each is counted against ``limits.max_watches`` (in all, per host, per
connection: server/rpc/admission.py) from its first instant; one over is
refused RESOURCE_EXHAUSTED. ``Check`` is a short call and is not counted.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from loaderd.server.rpc.admission import Admission, AdmissionRefused
from loaderd.wire.reasons import Reason, abort


class AdmittedHealth(health.HealthServicer):
    """The health service, with ``Watch`` calls admitted by ``admission``."""

    def __init__(self, admission: Admission) -> None:
        super().__init__()
        self._admission = admission

    def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext, send_response_callback: Any = None) -> Any:
        try:
            ticket = self._admission.admit_watch(context.peer())
        except AdmissionRefused as exc:
            abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), Reason.ADMISSION_LIMIT)
        if not context.add_callback(ticket.release):  # the call ended already: nothing to watch
            ticket.release()
            return iter(())
        return super().Watch(request, context, send_response_callback)
