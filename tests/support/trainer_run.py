"""One training run under the transformers Trainer; run by torchrun, one process per rank.

    PYTHONPATH=tests python -m torch.distributed.run --nproc-per-node 2 --standalone -m support.trainer_run SPEC_JSON

SPEC_JSON: {"loader": "torch" | "loaderd", "address": ..., "n": train items, "eval_n": eval items,
"batch_size": 8, "epochs": 2, "accumulation": 2, "seed": 7, "out": path prefix, "output_dir": path,
"save_steps": k, "cpu": false (default true: train on the accelerator; records end with the device), "stop_at": global step to stop at (after its checkpoint) or null, "resume": bool}

Each rank writes ``{out}.rank{r}.json``: the item indices of every batch the model saw in training, in
order, and in ``evaluate()`` after it. The torch run is the oracle: the plain Trainer over the real
datasets. (Run as a module: run as a file, tests/support would hide HuggingFace's ``datasets``.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from support.accelerate_run import exit_now
from support.datasets import Records

SEEN: list[list[Any]] = []
RECORD_DEVICE = False  # set by main from the spec: each batch's record ends with its device


class Tiny(torch.nn.Module):
    """A model the Trainer can train: records the items of every batch it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> dict[str, torch.Tensor]:
        SEEN.append([*index.tolist(), str(index.device)] if RECORD_DEVICE else index.tolist())
        return {"loss": (self.linear(x).squeeze(-1) - labels).pow(2).mean()}


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_training_stop = True  # after this step's checkpoint
        return control


def main(spec: dict[str, Any]) -> None:
    global RECORD_DEVICE
    RECORD_DEVICE = not spec.get("cpu", True)
    args = TrainingArguments(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["batch_size"], per_device_eval_batch_size=spec["batch_size"],
        num_train_epochs=spec["epochs"], gradient_accumulation_steps=spec["accumulation"], seed=spec["seed"],
        save_strategy="steps", save_steps=spec["save_steps"], report_to="none", use_cpu=spec.get("cpu", True), disable_tqdm=True,
        logging_strategy="no", dataloader_pin_memory=False,
    )
    torch.manual_seed(spec["seed"])
    model = Tiny()
    callbacks = [StopAt(spec["stop_at"])] if spec.get("stop_at") and not spec.get("resume") else []
    if spec["loader"] == "torch":
        trainer: Trainer = Trainer(model=model, args=args, train_dataset=Records(spec["n"]), eval_dataset=Records(spec["eval_n"]), callbacks=callbacks)
    else:
        from loaderd.integrations.transformers import LoaderdTrainer, RemoteDataset

        trainer = LoaderdTrainer(
            model=model, args=args, callbacks=callbacks,
            train_dataset=RemoteDataset(f"records-{spec['n']}", address=spec["address"]),
            eval_dataset=RemoteDataset(f"records-{spec['eval_n']}", address=spec["address"]),
        )
    resume = str(Path(spec["output_dir"]) / f"checkpoint-{spec['stop_at']}") if spec.get("resume") else None
    trainer.train(resume_from_checkpoint=resume)
    trained = list(SEEN)
    SEEN.clear()
    metrics = trainer.evaluate()
    record = {"train": trained, "eval": list(SEEN), "eval_loss": metrics["eval_loss"]}
    with open(f"{spec['out']}.rank{trainer.args.process_index}.json", "w") as out:
        json.dump(record, out)
    trainer.accelerator.wait_for_everyone()
    exit_now()  # no interpreter teardown: see support.accelerate_run.exit_now


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
