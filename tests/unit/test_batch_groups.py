"""batch_groups.add_ready: which ready batches join a whole batch's message, against a real BatchStream (no processes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from support.fakes import batch_delivery, dispatch_all, lone_stream, map_spec

from loaderd.server.rpc.batch_groups import GROUP_BATCHES, GROUP_BYTES, add_ready
from loaderd.server.scheduling.producer import END, Delivery
from loaderd.server.scheduling.stream import BatchStream

pytestmark = pytest.mark.timeout(10)


def planned(batches: int, window: int = 64) -> BatchStream:
    """A map-style stream with ``batches`` planned (its plan ended) and dispatched."""
    stream = lone_stream(map_spec(window=window))
    stream.add_plan([(seq,) for seq in range(batches)], end=True)
    dispatch_all(stream)
    return stream


def whole_but(*chunked: int, size: int = 10) -> Callable[[Delivery], bytes | None]:
    """A whole batch's message of ``size`` bytes naming its seq; None (it goes as a header and chunks) for the seqs
    ``chunked``."""
    return lambda delivery: None if delivery.seq in chunked else str(delivery.seq).encode().ljust(size)


def sent_first(stream: BatchStream) -> list[bytes]:
    """The group the servicer starts: the batch it took (waiting) as a whole batch's message."""
    first = stream.next_delivery(0)
    assert first is not None and first is not END
    return [str(first.seq).encode().ljust(10)]


def seqs(group: list[bytes]) -> list[int]:
    return [int(message) for message in group]


def test_the_ready_batches_behind_the_first_join_it_in_order() -> None:
    stream = planned(5)
    for seq in (3, 1, 0, 2):  # 4 is still being made
        stream.resolve(batch_delivery(seq))
    group = sent_first(stream)
    assert add_ready(group, lambda: stream.next_delivery(0), whole_but()) is None
    assert seqs(group) == [0, 1, 2, 3]
    assert stream.next_delivery(0) is None  # batch 4: not waited for


def test_nothing_ready_behind_the_first_leaves_it_alone() -> None:
    stream = planned(3)
    stream.resolve(batch_delivery(0))
    stream.resolve(batch_delivery(2))  # 1 is missing: 2 waits behind it
    group = sent_first(stream)
    assert add_ready(group, lambda: stream.next_delivery(0), whole_but()) is None
    assert seqs(group) == [0]


@pytest.mark.parametrize("stop", ["error", "chunked", "replay", "end"])
def test_what_cannot_join_is_handed_back_for_after_the_group(stop: str) -> None:
    """An error, a batch that goes as a header and chunks, a replayed batch (an iterable stream's resume drops it), or
    END ends the group and is handed back for next: the order stays the plan's."""
    stream = planned(2 if stop == "end" else 4)
    stream.resolve(batch_delivery(0))
    stream.resolve(batch_delivery(1))
    if stop != "end":
        if stop == "error":
            stream.resolve(Delivery(seq=2, error=b"remote error"))
        else:
            stream.resolve(dataclasses.replace(batch_delivery(2), replay=stop == "replay"))
        stream.resolve(batch_delivery(3))
    group = sent_first(stream)
    held = add_ready(group, lambda: stream.next_delivery(0), whole_but(2))
    assert seqs(group) == [0, 1]
    assert held is not None
    if stop == "end":
        assert held is END
    else:
        assert held.seq == 2 and (held.error is not None) == (stop == "error") and held.replay == (stop == "replay")
        assert stream.next_delivery(0).seq == 3  # still there for the turn after


def test_a_group_holds_at_most_group_batches() -> None:
    stream = planned(GROUP_BATCHES + 3)
    for seq in range(GROUP_BATCHES + 3):
        stream.resolve(batch_delivery(seq))
    group = sent_first(stream)
    assert add_ready(group, lambda: stream.next_delivery(0), whole_but()) is None
    assert seqs(group) == list(range(GROUP_BATCHES))
    assert stream.next_delivery(0).seq == GROUP_BATCHES


def test_no_batch_joins_once_the_group_holds_group_bytes() -> None:
    """Large structures (a batch's own may take MAX_HEADER_BYTES) stop a group by bytes before its count."""
    size = GROUP_BYTES // 3
    stream = planned(6)
    for seq in range(6):
        stream.resolve(batch_delivery(seq))
    group = sent_first(stream)
    add_ready(group, lambda: stream.next_delivery(0), whole_but(size=size))
    assert len(group) == 4  # 10 + 3 * size bytes: the third join reached GROUP_BYTES
    assert sum(len(m) for m in group) >= GROUP_BYTES
