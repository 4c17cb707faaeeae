"""Shared-memory batches ready at once, put in one message (``StreamResponse.slots``, protocol revision 7).

The servicer sends a stream's batches in their order. When the batch it sends lives in a slot, the batches
ready behind it that live in slots too go in the same message: one gRPC message, one wake-up of the client's
receiver thread and one of its consumer, for all of them (bench_limits.py: a small message down costs about
0.18 CPU ms of both processes). About half the sends found the next batch ready (the f32 workload, 2 workers,
one trainer). Only what is ready goes: a group never waits for a batch, so none arrives later than alone.

The rules:

* a group starts with a batch that went to a slot and was leased to the client's session;
* the batches ready now follow, in order, while each is leased as a slot too, until ``GROUP_BATCHES`` or
  ``GROUP_BYTES`` (a batch's structure alone may take ``MAX_HEADER_BYTES``; the client's receive limit is
  ``MAX_MESSAGE_BYTES``);
* the first delivery taken that cannot join (END, an error, a replayed batch, a batch that goes as bytes)
  is handed back, to be sent next, after the group.
"""

from __future__ import annotations

from collections.abc import Callable

from loaderd.server.scheduling.producer import END, Delivery

# At most this many batches in one message, and none added once its slot messages hold this many bytes.
GROUP_BATCHES = 16
GROUP_BYTES = 1 << 20


def add_ready(group: list[bytes], take_ready: Callable[[], Delivery | None], slot_message: Callable[[Delivery], bytes | None]) -> Delivery | None:
    """Add to ``group`` (slot messages, the first already in it) those of the batches ``take_ready`` hands out now.

    ``take_ready``: the stream's next delivery if it is there now, else None (it never waits). ``slot_message``: a
    batch's slot message, its slot leased; None if it goes as bytes (nothing leased). Returns the delivery taken that
    did not join, or None."""
    size = sum(len(message) for message in group)
    while len(group) < GROUP_BATCHES and size < GROUP_BYTES:
        delivery = take_ready()
        if delivery is None:
            return None
        if delivery is END or delivery.replay or delivery.error is not None:
            return delivery
        message = slot_message(delivery)
        if message is None:
            return delivery
        group.append(message)
        size += len(message)
    return None
