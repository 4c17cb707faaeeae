"""loaderd under HuggingFace accelerate (loaderd.integrations.accelerate), 2 processes on gloo, against
accelerate preparing torch's DataLoader over the real dataset in the same test.

One torchrun launch per run (accelerate's startup dominates): each rank records per epoch its batches'
item indices, what ``accumulate`` saw (``sync_gradients``, ``end_of_dataloader``), the device, and what
``gather_for_metrics`` gathered. Resume runs stop mid-epoch with ``save_state`` and go on in fresh
processes with ``load_state`` (the loader's own state) or ``skip_first_batches``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.daemons import RunningDaemon, running_daemon
from support.torchrun import torchrun

pytest.importorskip("accelerate")

N = 359  # odd: the DistributedSampler-style shards pad, the last batch is partial
DATASETS = {"squares-359": {"dataset": "support.datasets:Squares", "kwargs": {"n": N}}}
BASE_SPEC: dict[str, Any] = {"dataset": "squares-359", "n": N, "batch_size": 8, "epochs": 2, "accumulation": 4, "seed": 7}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="ld-acc-", workers=2) as running:
        yield running


def launch(tmp: Path, name: str, **spec: Any) -> list[dict[str, Any]]:
    """Run accelerate_run under torchrun with 2 processes; each rank's record."""
    return torchrun("support.accelerate_run", {**BASE_SPEC, **spec, "out": str(tmp / name)}, tmp, ACCELERATE_USE_CPU="true")


@pytest.mark.timeout(400)
def test_shards_epoch_end_gather_and_resume_as_accelerate_gives_a_dataloader(daemon: RunningDaemon, tmp_path: Path) -> None:
    torch_run = launch(tmp_path, "torch", loader="torch")
    ours = launch(tmp_path, "loaderd", loader="loaderd", address=daemon.address)
    for rank in (0, 1):
        assert ours[rank] == torch_run[rank], f"rank {rank}: loaderd differs from accelerate's DataLoader"
    # What the comparison pins: each rank its own half, accumulate sees the end, gather drops the padding.
    for epoch in range(2):
        halves = [[i for row in ours[rank]["epochs"][epoch]["batches"] for i in row["index"]] for rank in (0, 1)]
        assert not set(halves[0][:170]) & set(halves[1][:170]), "the ranks' shards overlap"
        assert sorted(ours[0]["epochs"][epoch]["gathered"]) == list(range(N)), "gather_for_metrics did not drop the padding"
        last = ours[0]["epochs"][epoch]["batches"][-1]
        assert last["end"] and last["sync"], "accumulate did not see the epoch's end"
    assert ours[0]["epochs"][0]["batches"] != ours[0]["epochs"][1]["batches"], "the epochs were not reshuffled"

    # Resume the classic way (load_state, skip_first_batches): stop after 9 batches of epoch 0, go on in
    # fresh processes (where skip_first_batches is exact for a DataLoader too).
    stop = {"stop_epoch": 0, "stop_after": 9, "state_dir": str(tmp_path / "skip-state"), "skip": True}
    launch(tmp_path, "stopped", loader="loaderd", address=daemon.address, **stop)
    resumed = launch(tmp_path, "resumed", loader="loaderd", address=daemon.address, resume=True, **stop)
    for rank in (0, 1):
        whole = ours[rank]["epochs"]
        assert resumed[rank]["epochs"][0]["batches"] == whole[0]["batches"][9:], f"rank {rank}: not resumed at batch 9"
        assert resumed[rank]["epochs"][1] == whole[1], f"rank {rank}: the next epoch differs"


@pytest.mark.timeout(200)
def test_resumes_from_its_own_state_in_any_epoch(daemon: RunningDaemon, tmp_path: Path) -> None:
    """register_for_checkpointing(loader): save_state keeps the loader's state, load_state restores it;
    exact in epoch 1 as well (where skip_first_batches over a DataLoader replays epoch 0's order)."""
    whole = launch(tmp_path, "whole", loader="loaderd", address=daemon.address, epochs=3)
    stop = {"stop_epoch": 1, "stop_after": 13, "state_dir": str(tmp_path / "state"), "skip": False, "epochs": 3}
    launch(tmp_path, "stopped", loader="loaderd", address=daemon.address, **stop)
    resumed = launch(tmp_path, "resumed", loader="loaderd", address=daemon.address, resume=True, **stop)
    for rank in (0, 1):
        assert resumed[rank]["epochs"][0]["batches"] == whole[rank]["epochs"][1]["batches"][13:], f"rank {rank}: not resumed at batch 13"
        assert resumed[rank]["epochs"][1] == whole[rank]["epochs"][2], f"rank {rank}: the epoch after the resumed one differs"
