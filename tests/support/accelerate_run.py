"""One training run under HuggingFace accelerate, as its docs write it; run by torchrun, one process per rank.

    PYTHONPATH=tests python -m torch.distributed.run --nproc-per-node 2 -m support.accelerate_run SPEC_JSON

(as a module: run as a file, tests/support would come first on sys.path and its datasets.py would hide
HuggingFace's ``datasets``, which accelerate imports).

SPEC_JSON: {"loader": "torch" | "loaderd", "address": ..., "dataset": "squares-359", "n": 359,
"batch_size": 8, "epochs": 2, "accumulation": 4, "seed": 7, "out": path prefix,
"stop_after": k (save_state after k batches of epoch stop_epoch, then exit), "stop_epoch": e,
"cpu": false (default true: place batches on the accelerator), "resume": true | false, "skip": true (resume by skip_first_batches; otherwise the loader is registered
for checkpointing and resumes from its own state), "state_dir": path}

Each rank writes ``{out}.rank{r}.json``: per epoch, each batch's item indices, ``sync_gradients`` and
``end_of_dataloader`` as ``accumulate`` saw them, the batch's device, and what ``gather_for_metrics``
gathered over the epoch. The torch run is the oracle: accelerate preparing a DataLoader over the
real dataset.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from support.datasets import Squares


def make_loader(spec: dict[str, Any], accelerator: Accelerator) -> Any:
    if spec["loader"] == "torch":
        return accelerator.prepare(DataLoader(Squares(spec["n"]), batch_size=spec["batch_size"], shuffle=True))
    from loaderd import RemoteDataLoader
    from loaderd.integrations.accelerate import prepare_loader

    return prepare_loader(accelerator, RemoteDataLoader(spec["dataset"], batch_size=spec["batch_size"], shuffle=True, address=spec["address"]))


def skip(spec: dict[str, Any], accelerator: Accelerator, loader: Any, batches: int) -> Any:
    if spec["loader"] == "torch":
        return accelerator.skip_first_batches(loader, batches)
    from loaderd.integrations.accelerate import skip_first_batches

    return skip_first_batches(loader, batches)


def main(spec: dict[str, Any]) -> None:
    accelerator = Accelerator(gradient_accumulation_steps=spec["accumulation"], cpu=spec.get("cpu", True))
    set_seed(spec["seed"])
    loader = make_loader(spec, accelerator)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    if not spec.get("skip", True):
        accelerator.register_for_checkpointing(loader)
    epochs: list[dict[str, Any]] = []
    first_epoch, first_step = 0, 0
    if spec.get("resume"):
        accelerator.load_state(spec["state_dir"])
        first_epoch, first_step = spec["stop_epoch"], spec["stop_after"]
    for epoch in range(first_epoch, spec["epochs"]):
        active = loader
        if epoch == first_epoch and spec.get("resume") and spec.get("skip", True):
            active = skip(spec, accelerator, loader, first_step)
        rows: list[dict[str, Any]] = []
        gathered: list[int] = []
        for step, (x, index) in enumerate(active):
            with accelerator.accumulate(model):
                rows.append({
                    "index": index.cpu().tolist(),
                    "sync": accelerator.sync_gradients,
                    "end": accelerator.gradient_state.end_of_dataloader,
                    "device": str(x.device),
                })
                loss = model(x).pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            gathered += accelerator.gather_for_metrics(index).cpu().tolist()
            if epoch == spec.get("stop_epoch") and step + 1 == spec.get("stop_after") and not spec.get("resume"):
                accelerator.save_state(spec["state_dir"])
                epochs.append({"epoch": epoch, "batches": rows, "gathered": gathered})
                write(spec, accelerator, epochs)
                return
        epochs.append({"epoch": epoch, "batches": rows, "gathered": gathered})
    write(spec, accelerator, epochs)


def write(spec: dict[str, Any], accelerator: Accelerator, epochs: list[dict[str, Any]]) -> None:
    with open(f"{spec['out']}.rank{accelerator.process_index}.json", "w") as out:
        json.dump({"epochs": epochs}, out)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    exit_now()


def exit_now() -> None:
    """Leave without the interpreter's teardown: a gloo thread still joinable when C++ static destructors
    run aborts the process ("terminate called without an active exception", SIGABRT; seen once in CI)
    after the record was written and every rank had finished."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
