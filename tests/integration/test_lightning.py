"""loaderd.integrations.lightning under PyTorch Lightning itself, with torch's DataLoader as the oracle.

Each run is tests/support/lightning_run.py in a subprocess (with DDP, Lightning starts rank 1 by
running the script again), writing every batch each rank's training_step and validation_step saw.
Under ``Trainer(strategy="ddp", devices=2)`` (gloo, CPU) and in one process, with
``seed_everything``, shuffling and an odd length (the DistributedSampler pads): every rank's batches,
every epoch, must be the DataLoader's; and a run stopped at a checkpoint and resumed in a fresh
process with ``trainer.fit(ckpt_path=...)`` must yield, stopped and resumed together, the
uninterrupted run's batches.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.daemons import TESTS_DIR, RunningDaemon, running_daemon

from loaderd import RemoteDataLoader
from loaderd.integrations.lightning import STATE_FORMAT, _LightningLoader

SCRIPT = TESTS_DIR / "support" / "lightning_run.py"
DATASETS: dict[str, Any] = {
    "train": {"dataset": "support.datasets:Squares", "kwargs": {"n": 359}},  # lightning_run.TRAIN_N
    "val": {"dataset": "support.datasets:Squares", "kwargs": {"n": 101}},  # lightning_run.VAL_N
}
RUN_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="ld-pl-", workers=2) as running:
        yield running


def fit(daemon: RunningDaemon, out: Path, devices: int, loaders: str, *options: str) -> list[list[dict[str, Any]]]:
    """Run the script; every rank's batches (in the order its steps saw them)."""
    command = [sys.executable, str(SCRIPT), str(out), daemon.address, str(devices), loaders, *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{' '.join(options)}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-8000:]}"
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(devices)]


def batches(seen: list[dict[str, Any]], loader: str, sanity: bool = True) -> list[dict[str, Any]]:
    """One loader's batches, without the loader's name (so that two loaders' compare), and without the sanity check's."""
    return [{k: v for k, v in x.items() if k != "loader"} for x in seen if x["loader"] == loader and (sanity or x["stage"] != "sanity")]


def stop_and_resume(daemon: RunningDaemon, tmp_path: Path, devices: int, steps: int, *options: str) -> list[list[dict[str, Any]]]:
    """Every rank's batches of a run stopped after ``steps`` training steps (checkpoint there) and resumed in a fresh process."""
    ckpt = tmp_path / f"ckpt-{steps}"
    stopped = fit(daemon, tmp_path / f"stop-{steps}", devices, "remote", "--max-steps", str(steps), "--ckpt-dir", str(ckpt), *options)
    resumed = fit(daemon, tmp_path / f"resume-{steps}", devices, "remote", "--resume", str(ckpt / "stop.ckpt"), *options)
    return [batches(s, "remote", sanity=False) + batches(r, "remote", sanity=False) for s, r in zip(stopped, resumed)]


@pytest.mark.timeout(150)
def test_ddp_two_ranks_as_a_dataloader_and_resume(daemon: RunningDaemon, tmp_path: Path) -> None:
    # One launch iterates both: a dict of a DataLoader and a RemoteDataLoader (train, lockstep) and
    # a list of the two (val, one after the other). shuffle=False on the training loaders: Lightning
    # shuffles a training loader's DistributedSampler anyway. Under DDP no sampler draws from the
    # global RNG (the DistributedSampler's permutation comes from seed and epoch), so sharing it is fine.
    both = fit(daemon, tmp_path / "both", 2, "both")
    per_epoch = 23 + 7  # ceil(ceil(359 / 2) / 8) training batches, ceil(ceil(101 / 2) / 8) val batches
    for rank, seen in enumerate(both):
        expected = batches(seen, "torch")
        assert batches(seen, "remote") == expected, f"rank {rank}"
        assert len(expected) == 3 * per_epoch + 2  # 3 epochs, the sanity check's 2 val batches
    trains = [[x["indices"] for x in batches(seen, "torch") if x["stage"] == "train"] for seen in both]
    epoch0 = [[i for batch in train[:23] for i in batch] for train in trains]  # each rank's shard: 180 of 359 items, one padded
    assert len(epoch0[0]) == len(epoch0[1]) == 180 and set(epoch0[0]) | set(epoch0[1]) == set(range(359))
    assert trains[0][:23] != trains[0][23:46], "the epochs were not reshuffled"

    # Checkpoint mid-epoch 1 (batch 7 of 23), resume: each rank takes its own state from rank 0's file.
    resumed = stop_and_resume(daemon, tmp_path, 2, 30)
    for rank, seen in enumerate(both):
        assert resumed[rank] == batches(seen, "remote", sanity=False), f"rank {rank}"


@pytest.mark.timeout(150)
def test_one_process_as_a_dataloader_and_resume(daemon: RunningDaemon, tmp_path: Path) -> None:
    # One process: the training loader's RandomSampler and every loader's base seed draw from the
    # global RNG, so the DataLoader's run is a run of its own. Lightning's extra iter() of a
    # non-DataLoader must draw nothing, or every epoch after would be shifted.
    # The remote run is stopped mid-epoch 1 (batch 30 of 45) and resumed: together, they must be the
    # DataLoader's run, all three epochs (epoch 2, after the resume: Lightning does not checkpoint the
    # global RNG, the loader's state carries it, or epoch 2 would shuffle as epoch 0).
    [expected] = fit(daemon, tmp_path / "torch", 1, "torch")
    trains = [x["indices"] for x in batches(expected, "torch") if x["stage"] == "train"]
    assert len(trains) == 3 * 45 and trains[:45] != trains[45:90]
    [resumed] = stop_and_resume(daemon, tmp_path, 1, 75)
    assert resumed == batches(expected, "torch", sanity=False)


@pytest.mark.timeout(150)
def test_one_process_resume_at_an_epochs_last_batch(daemon: RunningDaemon, tmp_path: Path) -> None:
    # A checkpoint at the last batch of epoch 0 (every batch out, none asked past, as Lightning
    # iterates a sized loader): the resumed run begins epoch 1 whole. Lightning resumes after that
    # epoch's validation, which the uninterrupted run ran after the checkpoint: the val loaders draw
    # from a generator of their own here, or the global RNG would be behind by their base seeds.
    [expected] = fit(daemon, tmp_path / "torch", 1, "torch", "--val-generator")
    [resumed] = stop_and_resume(daemon, tmp_path, 1, 45, "--val-generator")
    assert resumed == batches(expected, "torch", sanity=False)


@pytest.mark.timeout(30)
def test_state_of_another_world_size_is_refused(daemon: RunningDaemon) -> None:
    adapted = _LightningLoader(RemoteDataLoader("val", batch_size=8, address=daemon.address))
    try:
        state = adapted.state_dict()
        assert state["format"] == STATE_FORMAT and len(state["ranks"]) == 1
        before = torch.default_generator.get_state()
        torch.rand(3)
        adapted.load_state_dict(state)
        assert torch.equal(torch.default_generator.get_state(), before), "the global RNG is not put back"
        with pytest.raises(ValueError, match="of 2 process"):
            adapted.load_state_dict({**state, "ranks": state["ranks"] * 2})
        with pytest.raises(ValueError, match="not a loader state"):
            adapted.load_state_dict(state["ranks"][0]["loader"])
    finally:
        adapted.close()
