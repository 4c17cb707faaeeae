"""Whole batches ready at once, put in one message (``StreamResponse.batches``, protocol revision 7).

The servicer sends a stream's batches in their order. When the batch it sends fits in one message of its own (a
slot handle, or a small payload), the batches ready behind it that fit too go in the same message: one gRPC
message and one wake-up of the client's receiver thread (and usually one of its consumer) for all of them
(bench_limits.py: a small message down costs 0.12-0.18 CPU ms of both processes on the development VM). About half
the sends found the next batch ready (the f32 and u8 workloads over shared memory, 2 workers, one trainer). A group
never waits for a batch that is not ready.

The rules:

* a group starts with a batch whose message may be joined (``whole_message`` in the servicer): its slot leased to
  the client's session, or its payload at most ``JOINED_PAYLOAD_BYTES`` and in one message;
* the batches ready now follow, in order, while each may be joined too, until ``GROUP_BATCHES`` or ``GROUP_BYTES``
  (a batch's structure alone may take ``MAX_HEADER_BYTES``; the client's receive limit is ``MAX_MESSAGE_BYTES``);
* the first delivery taken that cannot join (END, an error, a replayed batch, a batch that goes as a header and
  chunks) is handed back, to be sent next, after the group.
"""

from __future__ import annotations

from collections.abc import Callable

from loaderd.server.scheduling.producer import END, Delivery

# At most this many batches in one message, and none added once its batches' messages hold this many bytes.
GROUP_BATCHES = 16
GROUP_BYTES = 1 << 20
# A payload sent as bytes joins a group only up to this size: joining copies it once more (~10 us at 64 KiB), a
# message of its own costs far more.
JOINED_PAYLOAD_BYTES = 64 << 10


def add_ready(group: list[bytes], take_ready: Callable[[], Delivery | None], whole_message: Callable[[Delivery], bytes | None]) -> Delivery | None:
    """Add to ``group`` (whole batches' messages, the first already in it) those of the batches ``take_ready`` hands
    out now.

    ``take_ready``: the stream's next delivery if it is there now, else None (it never waits). ``whole_message``: a
    batch's one message (its slot leased, or its bytes copied and its slot released), or None if it must go as a
    header and chunks (nothing leased, nothing released). Returns the delivery taken that did not join, or None: END,
    an error or a replay, else a batch ``whole_message`` refused (the caller need not ask again)."""
    size = sum(len(message) for message in group)
    while len(group) < GROUP_BATCHES and size < GROUP_BYTES:
        delivery = take_ready()
        if delivery is None:
            return None
        if delivery is END or delivery.replay or delivery.error is not None:
            return delivery
        message = whole_message(delivery)
        if message is None:
            return delivery
        group.append(message)
        size += len(message)
    return None
