"""The Status call's reply, cut to fit one gRPC message."""

from __future__ import annotations

from loaderd.v1 import loaderd_pb2 as pb

# A Status reply fits gRPC's default receive limit (4 MiB), which `loaderd status` and grpcurl keep.
STATUS_MAX_BYTES = (4 << 20) - (64 << 10)


def bounded_status(reply: pb.StatusResponse, limit: int) -> pb.StatusResponse:
    """``reply`` cut to fit one message: the stream list goes first (newest streams dropped)."""
    while reply.ByteSize() > limit and len(reply.streams):
        del reply.streams[len(reply.streams) // 2 :]
    while reply.ByteSize() > limit and len(reply.shares):
        del reply.shares[len(reply.shares) // 2 :]
    return reply
