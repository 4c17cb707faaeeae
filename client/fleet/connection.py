"""One gRPC channel per (process, daemon address), and the unary calls on it."""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import grpc

# gRPC imports its channel implementation on the first channel a process makes
# (~6 ms here). Importing it with loaderd moves that into `import loaderd`, out
# of a fresh process's first RemoteDataLoader (and under loaderd's gc.freeze()).
try:
    import grpc._channel
    import grpc.experimental
except ImportError:  # a later gRPC moved them: the first channel imports what it needs, as before
    pass

from loaderd.channel.closer import Finalizer
from loaderd.channel.closer import stop as stop_closer
from loaderd.channel.credentials import Credentials, open_channel
from loaderd.channel.threads import join_all, still_running
from loaderd.errors import LoaderdError
from loaderd.shm.session import ResumeRefused, ShmSession
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.v1 import loaderd_pb2_grpc as pb_grpc
from loaderd.wire.limits import MAX_MESSAGE_BYTES

log = logging.getLogger("loaderd.connection")

# How long one look-up of a daemon may take (a loader retries until its failover_timeout).
PROBE_TIMEOUT_S = 2.0

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A daemon that restarts on the same address is found again within a quarter
    # second (gRPC's default reconnect backoff grows to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
    # A daemon that stops answering without closing the connection (frozen, its host gone)
    # is found out within 15 s: the connection breaks and the loader fails over. gRPC core
    # waits for a ping's ack ping_timeout_ms, not keepalive_timeout_ms, and that defaults to
    # a minute (chttp2 transport; the name is not in grpc's public headers): without it a
    # frozen daemon was noticed after ~65 s.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]


class DaemonConnection:
    """A channel to one daemon, with one set of credentials. Shared by every loader of a process that uses both."""

    def __init__(self, address: str, credentials: Credentials) -> None:
        self.address = address
        self.credentials = credentials
        self.channel = open_channel(address, credentials, CHANNEL_OPTIONS)
        self.stub = pb_grpc.LoaderStub(self.channel)
        self._stream_batches = self.channel.stream_stream(
            "/loaderd.v1.Loader/StreamBatches",
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=None,  # raw bytes: payload chunks are read without a copy
        )
        self._session: ShmSession | None = None
        self._session_lock = threading.Lock()
        # Cancellers of open streams, run at close.
        self._stream_closers: list[Finalizer] = []

    def track_stream(self, closer: Finalizer) -> None:
        """Remember how to cancel an open stream, so close() can end it."""
        with self._session_lock:
            self._stream_closers = [c for c in self._stream_closers if c.alive]
            self._stream_closers.append(closer)

    def stream_batches(self, requests: Iterator[pb.StreamRequest]) -> Any:
        """Open a StreamBatches call whose responses arrive as raw bytes (see loaderd.wire.framing)."""
        return self._stream_batches(requests)

    def close(self) -> None:
        """Cancel open streams, end the shared-memory session and close the channel (their threads
        then leave; the process's exit joins them)."""
        with self._session_lock:
            closers, self._stream_closers = self._stream_closers, []
            session, self._session = self._session, None
        for closer in closers:
            closer()  # runs at most once
        if session is not None:
            session.close()
        self.channel.close()

    def session(self) -> ShmSession:
        """This process's shared-memory session with the daemon (opened on first use, reopened if it ended)."""
        with self._session_lock:
            previous = self._session
            if previous is None or not previous.alive:
                try:
                    # A session whose call ended while this process lived (stopped past the daemon's keepalive) is resumed.
                    self._session = ShmSession(self.stub, self.address, PROBE_TIMEOUT_S, previous=previous)
                except ResumeRefused:
                    # A new session; the old one keeps its lock, and the daemon its slots, until this process exits.
                    self._session = ShmSession(self.stub, self.address, PROBE_TIMEOUT_S)
            session = self._session
            assert session is not None
            return session

    def forget_in_child(self) -> None:
        """In a forked child: let go of what this process inherited that would tell the daemon the parent lives."""
        session = self._session
        if session is not None:
            session.let_go()  # closes this process's copy of the descriptor: the parent's lock stays

    def describe_later(self, dataset: str, timeout: float = PROBE_TIMEOUT_S) -> grpc.Future:
        """The daemon's description of ``dataset``, as a call in flight: ``result()`` returns the
        DescribeDatasetResponse or raises grpc.RpcError as is (the caller decides what it means)."""
        return self.stub.DescribeDataset.future(pb.DescribeDatasetRequest(name=dataset), timeout=timeout)


_connections: dict[tuple[str, Credentials], DaemonConnection] = {}
_lock = threading.Lock()
# Set when the interpreter exits: threads that would keep calling daemons (fleet monitors) stop.
EXITING = threading.Event()
# How long the exit waits for the threads of the process's calls (closing cancels them all).
EXIT_JOIN_S = 1.0


# A forked child's copies of its parent's connections: kept, never used or closed (collecting
# them would run gRPC's teardown on the parent's state, which is not this process's).
_inherited: list[DaemonConnection] = []


def _forget_parents_connections() -> None:
    """In a forked child: the child opens its own connections on first use."""
    global _lock
    _lock = threading.Lock()  # a parent's thread may have held it at the fork
    for conn in _connections.values():
        conn.forget_in_child()
    _inherited.extend(_connections.values())
    _connections.clear()


os.register_at_fork(after_in_child=_forget_parents_connections)


def get_connection(address: str, credentials: Credentials) -> DaemonConnection:
    """The process's connection to ``address`` with ``credentials``; a forked child gets its own."""
    key = (address, credentials)
    with _lock:
        if EXITING.is_set():  # a fleet monitor's last round: no channel is opened after the exit closed them
            raise LoaderdError("the process is exiting")
        conn = _connections.get(key)
        if conn is None:
            conn = _connections[key] = DaemonConnection(address, credentials)
        return conn


@atexit.register
def _close_all() -> None:
    """Close every channel before the interpreter tears down.

    Exiting with gRPC calls still open (a session, an iterator kept alive)
    lets gRPC's own threads be destroyed mid-flight, which aborts the process
    ("terminate called without an active exception"). An epoch, lane or call
    still alive here is not finalized at exit (loaderd.channel.closer): closing
    its connection cancels its call, and the session's end gives its slots back.
    """
    EXITING.set()
    # What dropped loaders left open is closed first, on the closer thread (loaderd.channel.closer).
    if not stop_closer(EXIT_JOIN_S):
        log.warning("loaderd: closing what dropped loaders left open took over %g s at exit", EXIT_JOIN_S)
    with _lock:
        connections = list(_connections.values())
        _connections.clear()
    for conn in connections:
        conn.close()
    # Closing cancels every call; give the threads that were inside one (receivers, session
    # watchers, gRPC's request senders, which our closed request queues let go, fleet monitors)
    # a moment to leave: each by its handle (loaderd.channel.threads).
    join_all(still_running(), EXIT_JOIN_S)
