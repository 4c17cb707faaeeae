"""Whole batches ready at once travel in one message (StreamResponse.batches, protocol revision 7).

The daemon's servicer puts together the batches that are ready when it sends, without waiting for more: those in
shared-memory slots, and those of at most 64 KiB sent as bytes (server/rpc/batch_groups.py). The client's receiver
posts each as it would a lone batch. Batches stay torch's, in order.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from support import datasets
from support.compare import assert_same_batches
from support.daemons import daemon_status, oracle_loader, running_daemon, wait_for

from loaderd import RemoteDataLoader
from loaderd.stream import call_receiver
from loaderd.wire.framing import Frame, read_frame

N = 40
BATCH = 4
SMALL = 2  # 4 items of 2 float32 and an int: inline bytes, far under 64 KiB
LARGE = 8192  # 128 KiB batches: above INLINE_BYTES (server/shm/arena.py), so over shared memory they go as slots


def batches_computed(address: str) -> int:
    return sum(d.batches_computed for d in daemon_status(address).datasets)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("transport", "width", "grouped"),
    [("shm", LARGE, True), ("shm", SMALL, True), ("grpc", SMALL, True), ("grpc", LARGE, False)],
    ids=["shm-slots", "shm-inline", "grpc-small", "grpc-large"],
)
def test_batches_ready_behind_a_late_one_share_its_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport: str, width: int, grouped: bool
) -> None:
    """Batch 0 waits in one worker while the other makes batches 1 and 3 (each worker holds two tasks): once batch 0
    is there, the batches ready behind it go with it, in one message, except payloads over 64 KiB sent as bytes
    (each its own header and chunks). Every batch is torch's."""
    gate = tmp_path / "gate"
    spec = {"gated": {"dataset": "support.datasets:Gated", "kwargs": {"n": N, "gate": str(gate), "width": width}}}
    carried: list[int | str] = []  # per message the receiver read: how many batches a Batches message held, else its kind

    def spy(raw: bytes) -> Frame:
        frame = read_frame(raw)
        carried.append(len(frame.message.batches.batches) if frame.kind == "batches" and frame.message is not None else frame.kind)
        return frame

    monkeypatch.setattr(call_receiver, "read_frame", spy)
    with running_daemon(spec, prefix="ld-groups-", workers=2) as daemon:
        loader = RemoteDataLoader("gated", address=daemon.address, batch_size=BATCH, num_workers=2, prefetch_factor=4, transport=transport)
        got: list[Any] = []
        reader = threading.Thread(target=lambda: got.extend(loader), name="epoch-reader")  # an epoch opens at its first batch
        reader.start()
        try:
            wait_for(lambda: batches_computed(daemon.address) >= 3, 30, "three batches made while batch 0 waits at its gate")
        finally:
            gate.touch()
            reader.join(30)
        assert not reader.is_alive(), "the epoch did not end"
        want = list(oracle_loader(datasets.Gated(N, str(gate), width=width), batch_size=BATCH))
        assert_same_batches(got, want)
    groups = [n for n in carried if isinstance(n, int)]
    assert (max(groups, default=1) >= 2) == grouped, carried
    if grouped:
        assert sum(groups) + carried.count("batch") == N // BATCH, carried
