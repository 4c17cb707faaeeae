"""One gRPC channel per (process, daemon address), and the unary calls on it."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from loaderd.errors import LoaderdError, error_from_rpc
from loaderd.session import ShmSession
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.v1 import loaderd_pb2_grpc as pb_grpc

ADDRESS_ENV = "LOADERD_ADDRESS"
# How long a client waits for a daemon that is not (yet) answering.
CONNECT_TIMEOUT_S = 30.0

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


def resolve_address(address: str | None) -> str:
    """The address to use: the argument, else $LOADERD_ADDRESS."""
    address = address or os.environ.get(ADDRESS_ENV)
    if not address:
        raise LoaderdError(f"no daemon address: pass address=... or set ${ADDRESS_ENV}")
    return address.removeprefix("tcp://")


class DaemonConnection:
    """A channel to one daemon. Shared by every loader of a process."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.LoaderStub(self.channel)
        self._stream_batches = self.channel.stream_stream(
            "/loaderd.v1.Loader/StreamBatches",
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=None,  # raw bytes: payload chunks are read without a copy
        )
        self._session: ShmSession | None = None
        self._session_lock = threading.Lock()

    def stream_batches(self, requests: Iterator[pb.StreamRequest]) -> Any:
        """Open a StreamBatches call whose responses arrive as raw bytes (see loaderd.frames)."""
        return self._stream_batches(requests)

    def session(self) -> ShmSession:
        """This process's shared-memory session with the daemon (opened on first use, reopened if it ended)."""
        with self._session_lock:
            if self._session is None or not self._session.alive:
                self._session = ShmSession(self.stub, self.address)
            return self._session

    def describe(self, dataset: str) -> pb.DescribeDatasetResponse:
        try:
            return self.stub.DescribeDataset(
                pb.DescribeDatasetRequest(name=dataset), timeout=CONNECT_TIMEOUT_S, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.address) from None


_connections: dict[tuple[int, str], DaemonConnection] = {}
_lock = threading.Lock()


def get_connection(address: str) -> DaemonConnection:
    """The process's connection to ``address``; a forked child gets its own."""
    key = (os.getpid(), address)
    with _lock:
        conn = _connections.get(key)
        if conn is None:
            conn = _connections[key] = DaemonConnection(address)
        return conn
