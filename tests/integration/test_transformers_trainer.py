"""loaderd under the transformers Trainer (loaderd.integrations.transformers), 2 processes on gloo, against
the plain Trainer over the real datasets in the same test.

Each rank records the items of every batch its model saw, in training and in ``evaluate()``. A run
stopped after a checkpoint mid-epoch goes on in fresh processes with ``train(resume_from_checkpoint=...)``,
which skips the resumed epoch's first batches through accelerate's ``skip_first_batches`` (the slow path).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.daemons import RunningDaemon, running_daemon
from support.torchrun import torchrun

pytest.importorskip("transformers")

N, EVAL_N = 103, 21  # odd: the shards pad, the last batches are partial
COLLATE = "transformers.data.data_collator:default_data_collator"  # the Trainer's own, without a tokenizer
DATASETS = {
    f"records-{n}": {"dataset": "support.datasets:Records", "kwargs": {"n": n}, "collate_fn": COLLATE} for n in (N, EVAL_N)
}
# 13 batches of 4 per rank and epoch, 2 per optimizer step: steps 1-7 in epoch 0; checkpoint at step 4.
BASE_SPEC: dict[str, Any] = {"n": N, "eval_n": EVAL_N, "batch_size": 4, "epochs": 2, "accumulation": 2, "seed": 7, "save_steps": 4}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="ld-hf-", workers=2) as running:
        yield running


def launch(tmp: Path, name: str, **spec: Any) -> list[dict[str, Any]]:
    """Run trainer_run under torchrun with 2 processes; each rank's record."""
    full = {**BASE_SPEC, "output_dir": str(tmp / f"{name}-out"), **spec, "out": str(tmp / name)}
    return torchrun("support.trainer_run", full, tmp, TOKENIZERS_PARALLELISM="false")


@pytest.mark.timeout(400)
def test_trainer_trains_evaluates_and_resumes_as_over_the_real_datasets(daemon: RunningDaemon, tmp_path: Path) -> None:
    oracle = launch(tmp_path, "torch", loader="torch")
    ours = launch(tmp_path, "loaderd", loader="loaderd", address=daemon.address)
    for rank in (0, 1):
        assert ours[rank]["train"] == oracle[rank]["train"], f"rank {rank}: training batches differ from the Trainer's own"
        assert ours[rank]["eval"] == oracle[rank]["eval"], f"rank {rank}: evaluation batches differ"
        assert ours[rank]["eval_loss"] == oracle[rank]["eval_loss"]
    shards = [{i for batch in ours[rank]["train"][:13] for i in batch} for rank in (0, 1)]
    assert len(shards[0] | shards[1]) == N, "the two ranks' first epochs do not cover the dataset"

    # Stop after the checkpoint at step 4 (8 batches into epoch 0), resume in fresh processes.
    stop = {"stop_at": 4, "output_dir": str(tmp_path / "resume-out")}
    stopped = launch(tmp_path, "stopped", loader="loaderd", address=daemon.address, **stop)
    resumed = launch(tmp_path, "resumed", loader="loaderd", address=daemon.address, resume=True, **stop)
    for rank in (0, 1):
        assert stopped[rank]["train"] == ours[rank]["train"][:8]
        assert resumed[rank]["train"] == ours[rank]["train"][8:], f"rank {rank}: the resumed run's batches differ from the uninterrupted run's"
