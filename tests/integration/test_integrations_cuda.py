"""The framework adapters on a CUDA device: each framework places loaderd's batches on the GPU as it
places a DataLoader's, with the same values (one process each; the 2-process tests run on the CPU).

Skipped without CUDA (CI has none); run on a GPU machine with ``python -m pytest tests/integration/test_integrations_cuda.py``.
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
from support.torchrun import script_env

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

COLLATE = "transformers.data.data_collator:default_data_collator"
DATASETS: dict[str, Any] = {
    "train": {"dataset": "support.datasets:Squares", "kwargs": {"n": 359}},
    "val": {"dataset": "support.datasets:Squares", "kwargs": {"n": 101}},
    "squares-359": {"dataset": "support.datasets:Squares", "kwargs": {"n": 359}},
    **{f"records-{n}": {"dataset": "support.datasets:Records", "kwargs": {"n": n}, "collate_fn": COLLATE} for n in (103, 21)},
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="ld-cuda-", workers=2) as running:
        yield running


def run(command: list[str], tmp: Path) -> None:
    done = subprocess.run(command, env=script_env(), capture_output=True, text=True, timeout=180, cwd=tmp, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.mark.timeout(400)
def test_lightning_places_batches_on_the_gpu(daemon: RunningDaemon, tmp_path: Path) -> None:
    # Separate runs: in one process, two shuffled loaders side by side would share the global RNG's draws.
    script = str(TESTS_DIR / "support" / "lightning_run.py")
    seen = {}
    for loaders in ("torch", "remote"):
        run([sys.executable, script, str(tmp_path / loaders), daemon.address, "1", loaders, "--accelerator", "gpu", "--epochs", "2"], tmp_path)
        records = json.loads((tmp_path / f"{loaders}.rank0.json").read_text())
        seen[loaders] = [{k: v for k, v in x.items() if k != "loader"} for x in records]
    assert seen["remote"] == seen["torch"] and seen["remote"], "Lightning's batches from loaderd differ from its DataLoader's"
    assert {x["types"][3] for x in seen["remote"]} == {"cuda"}, seen["remote"][0]


@pytest.mark.timeout(400)
def test_accelerate_places_batches_on_the_gpu(daemon: RunningDaemon, tmp_path: Path) -> None:
    records = []
    for loader in ("torch", "loaderd"):
        spec = {"dataset": "squares-359", "n": 359, "batch_size": 8, "epochs": 2, "accumulation": 4, "seed": 7, "cpu": False,
                "loader": loader, "address": daemon.address, "out": str(tmp_path / loader)}
        run([sys.executable, "-m", "support.accelerate_run", json.dumps(spec)], tmp_path)
        records.append(json.loads((tmp_path / f"{loader}.rank0.json").read_text()))
    assert records[1] == records[0], "accelerate's batches from loaderd differ from its DataLoader's"
    assert {row["device"] for epoch in records[1]["epochs"] for row in epoch["batches"]} == {"cuda:0"}


@pytest.mark.timeout(400)
def test_the_trainer_places_batches_on_the_gpu(daemon: RunningDaemon, tmp_path: Path) -> None:
    records = []
    for loader in ("torch", "loaderd"):
        spec = {"n": 103, "eval_n": 21, "batch_size": 4, "epochs": 1, "accumulation": 2, "seed": 7, "save_steps": 1000, "cpu": False,
                "loader": loader, "address": daemon.address, "out": str(tmp_path / loader), "output_dir": str(tmp_path / f"{loader}-out")}
        run([sys.executable, "-m", "support.trainer_run", json.dumps(spec)], tmp_path)
        records.append(json.loads((tmp_path / f"{loader}.rank0.json").read_text()))
    assert records[1]["train"] == records[0]["train"] and records[1]["eval"] == records[0]["eval"]
    assert {batch[-1] for batch in records[1]["train"] + records[1]["eval"]} == {"cuda:0"}
