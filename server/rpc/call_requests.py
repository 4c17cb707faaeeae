"""CallRequests: one StreamBatches call's requests, read on a thread of their own.

A call carries one epoch's stream after another (protocol revision 4): an
``open``, that epoch's ``plan`` messages, and, once the client has every batch
of it, the next ``open`` on the same call. That spares each epoch a new call,
new threads on both sides and a handler dispatch.

The rules between the reader and the call's handler thread:

* the handler reads the call's first request itself (under the handshake
  alarm), opens its stream, then ``attach``es it (the first attach starts the
  reader);
* the reader hands every ``plan`` to the stream attached now (one that is
  closed, or none, drops it: a credit sent after the end means nothing);
* an ``open`` goes to the handler (``next_open``), and the reader reads no
  further until the handler has attached that epoch's stream (or given up),
  so a plan always reaches the epoch it was sent for; an ``open`` while the
  attached stream's plan is still open is a bad request, which goes to the
  stream like a plan (whose check refuses it);
* a later message that does not parse (``BadRequestError`` from the request
  iterator) goes to ``on_bad`` with the stream attached then, and the reader
  ends: the client hears why, and the handler does not wait on a reader that
  is gone;
* ``stop`` (idempotent) ends the reader's waits; the reader returns by itself
  when the client half-closes or the call ends, and closes the requests' generator.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator

import grpc

from loaderd.server.rpc.requests import BadRequestError
from loaderd.server.scheduling.stream import BatchStream
from loaderd.v1 import loaderd_pb2 as pb

# How often a blocked wait re-checks its stop signal.
_POLL_S = 0.25


class CallRequests:
    """The request side of one StreamBatches call, after its first message."""

    def __init__(
        self,
        requests: Generator[pb.StreamRequest, None, None],
        on_plan: Callable[[BatchStream, pb.StreamRequest], None],
        name: str,
        *,
        on_bad: Callable[[BatchStream, BadRequestError], None],
    ) -> None:
        """``on_plan(stream, request)`` takes a plan for the attached stream, ``on_bad(stream, error)``
        a message that did not parse (both on the reader thread)."""
        self._requests = requests
        self._on_plan = on_plan
        self._on_bad = on_bad
        self._name = name
        self._cond = threading.Condition()
        self._stream: BatchStream | None = None
        self._next: pb.OpenStream | None = None  # an `open` read and not yet taken by the handler
        self._unattached = False  # an `open` was read and its stream is not attached yet
        self._done = False  # the client half-closed, or the call ended
        self._stopped = False
        self._reading = False

    @property
    def stream(self) -> BatchStream | None:
        """The stream attached now (closed ones included)."""
        return self._stream

    def attach(self, stream: BatchStream) -> None:
        """Plans go to ``stream`` from now on (the epoch the last ``open`` asked for)."""
        with self._cond:
            self._stream = stream
            self._unattached = False
            self._cond.notify_all()
            start, self._reading = not self._reading, True
        if start:
            threading.Thread(target=self._read, name=self._name, daemon=True).start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def next_open(self, timeout: float, go_on: Callable[[], bool]) -> pb.OpenStream | None:
        """The next epoch's ``open``, or None: none within ``timeout`` (> 0), the client will send none
        (half-closed, call over), the reader was stopped, or ``go_on()`` turned False."""
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._next is None:
                left = deadline - time.monotonic()
                if self._done or self._stopped or left <= 0 or not go_on():
                    return None
                self._cond.wait(min(_POLL_S, left))
            opening, self._next = self._next, None
            return opening

    def _read(self) -> None:
        try:
            for request in self._requests:
                kind = request.WhichOneof("kind")
                with self._cond:
                    stream = self._stream
                assert stream is not None  # attached before the reader starts
                if kind == "open" and (stream.closed or stream.finished or stream.plan_end):
                    with self._cond:
                        self._next, self._unattached = request.open, True
                        self._cond.notify_all()
                        # What follows is the new epoch's: wait until its stream is attached.
                        while self._unattached and not self._stopped:
                            self._cond.wait(_POLL_S)
                        if self._stopped:
                            return
                elif not stream.closed:
                    # A plan; or an `open` mid-plan, a bad request that the plan's check refuses.
                    self._on_plan(stream, request)
        except grpc.RpcError:
            pass  # the call ended; the handler sees it
        except BadRequestError as exc:
            with self._cond:
                stream = self._stream
            assert stream is not None
            self._on_bad(stream, exc)
        finally:
            # Closed here, by the thread that reads it: one left suspended would hold its source (a direct
            # connection's descriptor: server/rpc/direct_socket.py) until collected.
            self._requests.close()
            with self._cond:
                self._done = True
                self._cond.notify_all()
