"""Constants the daemon and the client must agree on."""

from __future__ import annotations

# The largest gRPC message either side accepts. Data chunks are far smaller
# (``chunk_bytes``, 4 MiB by default); this bounds headers and plans.
MAX_MESSAGE_BYTES = 64 << 20
# Where `loaderd serve` listens when its config has no listen:, and where a loader looks when given no address.
DEFAULT_ADDRESS = "unix:///tmp/loaderd.sock"
# The protocol revision this code speaks (DescribeDatasetResponse.protocol_revision from a daemon;
# OpenStream and SessionHello.protocol_revision from a client). Each side serves or uses only a
# peer of the same revision (loaderd is unreleased: no older revision is kept working). Revision 5:
# a session's challenge carries its id, usable before `ready`; a StreamBatches call takes the next
# epoch's `open` after its StreamEnd; a plan carries the releases of its stream's slots. Revision 6:
# clients name their revision, so a daemon refuses another's too. Revision 7: shared-memory batches ready at
# once travel in one message (StreamResponse.batches), as do small batches. Revision 8: a same-host call's
# responses may travel on the daemon's direct socket (loaderd/wire/direct_frames.py).
PROTOCOL_REVISION = 8


def revision_mismatch(theirs: int, me: str) -> str:
    """Why a peer of protocol revision ``theirs`` is refused by this side (``me``: "client" or "daemon"),
    naming both revisions; the caller puts the peer in front ("loaderd at HOST:PORT ", "the client ")."""
    older = "an older" if theirs < PROTOCOL_REVISION else "a newer"
    return (
        f"runs {older} loaderd (protocol revision {theirs}; this {me} speaks revision {PROTOCOL_REVISION}): "
        "run the same loaderd release on the daemons and their clients"
    )
# The largest serialized batch structure (its ``Value``: everything but array
# bytes) a batch may have; with a data chunk (``chunk_bytes`` <= MAX_CHUNK_BYTES)
# its header still fits in one message.
MAX_HEADER_BYTES = 32 << 20
# Set (to the module's name) while a daemon's process imports a module its config names. A
# RemoteDataLoader made then is a script that trains at import (no ``if __name__ == "__main__":``):
# it would wait for the very daemon that is starting; it refuses at once, naming the module.
IMPORTING_CONFIG_ENV = "LOADERD_IMPORTING_CONFIG_MODULE"
MAX_CHUNK_BYTES = 16 << 20

# Where workers' shared-memory segments live, and how their names start:
# ``loaderd-<daemon pid>-<token>-w<worker>g<generation>-<n>`` (see server/shm/arena.py).
SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "loaderd-"


def is_segment_name(name: str) -> bool:
    """Whether ``name`` can be one of a daemon's segments (a client maps nothing else)."""
    return name.startswith(SEGMENT_PREFIX) and "/" not in name and name not in (".", "..")
