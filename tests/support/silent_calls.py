"""A hostile peer: many silent calls on one connection, from a process of its own.

``python silent_calls.py ADDRESS '{"stream": 1100, "session": 40, "watch": 20}'`` opens that many
``StreamBatches`` and ``Session`` calls that never send a message, and health ``Watch`` calls, all
on one HTTP/2 connection (one channel), and prints a JSON line each time a call ends:
``{"refused": {kind: n}, "other": [...]}`` (refused: RESOURCE_EXHAUSTED with the admission reason;
other: any other end). It holds the rest open until its stdin closes (or it is killed).
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loaderd.wire.reasons import Reason, reason_of

METHODS = {"stream": "/loaderd.v1.Loader/StreamBatches", "session": "/loaderd.v1.Loader/Session"}


class SilentCalls:
    def __init__(self, address: str, calls: dict[str, int]) -> None:
        self.address = address
        self.calls = calls
        self.refused: dict[str, int] = {}
        self.other: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            calls: list[Any] = []
            for kind, n in self.calls.items():
                for _ in range(n):
                    if kind == "watch":
                        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
                    else:
                        call = channel.stream_stream(METHODS[kind])(self._silence())
                    call.add_done_callback(lambda call, kind=kind: self._ended(kind, call))
                    calls.append(call)
            sys.stdin.read()  # until the test closes it
            self._stop.set()
            for call in calls:
                call.cancel()

    def _silence(self) -> Iterator[bytes]:
        self._stop.wait()
        return
        yield b""  # a generator that sends nothing

    def _ended(self, kind: str, call: Any) -> None:
        if self._stop.is_set():
            return
        with self._lock:
            if call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and reason_of(call) is Reason.ADMISSION_LIMIT:
                self.refused[kind] = self.refused.get(kind, 0) + 1
            else:
                self.other.append(f"{kind}: {call.code()} {call.details()}")
            print(json.dumps({"refused": self.refused, "other": self.other}), flush=True)


if __name__ == "__main__":
    SilentCalls(sys.argv[1], json.loads(sys.argv[2])).run()
