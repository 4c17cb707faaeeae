"""A Lightning training script for tests/integration/test_lightning.py, written as Lightning's docs write one.

Run as a file (Lightning's DDP launcher starts rank 1 by running ``sys.argv`` again)::

    python lightning_run.py OUT ADDRESS DEVICES LOADERS [--max-steps K --ckpt-dir D] [--resume PATH] [--val-generator] [--accelerator gpu]

LOADERS is ``torch`` (DataLoader over the real dataset), ``remote`` (RemoteDataLoader, through
``loaderd.integrations.lightning.RemoteLoaders``) or ``both`` (a dict of the two, iterated in
lockstep; each gets its own sampler). Each rank writes OUT.rank<r>.json: every batch its
training_step and validation_step saw (stage, epoch, batch index, loader, the items' indices, a
digest of the values, the batch's types and device).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support.datasets

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from loaderd import RemoteDataLoader
from loaderd.integrations.lightning import RemoteLoaders
from support.datasets import Squares

TRAIN_N, VAL_N, BATCH = 359, 101, 8
SEED = 1234


def describe(batch: Any) -> dict[str, Any]:
    values, index = batch
    return {
        "indices": index.tolist(),
        "digest": hashlib.sha256(values.cpu().numpy().tobytes()).hexdigest()[:16],
        "types": [type(values).__name__, str(values.dtype), str(index.dtype), values.device.type],
    }


class LitSquares(RemoteLoaders, L.LightningModule):
    def __init__(self, address: str, loaders: str, val_generator: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.address = address
        self.loaders = loaders
        # The validation loaders' base seeds from a generator of their own, not the global RNG.
        self.val_generator = val_generator
        self.seen: list[dict[str, Any]] = []

    def _loader(self, dataset: str, n: int, shuffle: bool, generator: bool = False) -> dict[str, Any]:
        made: dict[str, Any] = {}
        if self.loaders in ("torch", "both"):
            own = torch.Generator().manual_seed(5) if generator else None
            made["torch"] = DataLoader(Squares(n), batch_size=BATCH, shuffle=shuffle, generator=own)
        if self.loaders in ("remote", "both"):
            own = torch.Generator().manual_seed(5) if generator else None
            made["remote"] = RemoteDataLoader(dataset, batch_size=BATCH, shuffle=shuffle, generator=own, address=self.address)
        return made

    def train_dataloader(self) -> Any:
        # shuffle=False: Lightning shuffles a training DataLoader's DistributedSampler anyway
        loaders = self._loader("train", TRAIN_N, shuffle=self.trainer.world_size == 1)
        return loaders if len(loaders) > 1 else next(iter(loaders.values()))

    def val_dataloader(self) -> Any:
        loaders = self._loader("val", VAL_N, shuffle=False, generator=self.val_generator)
        return list(loaders.values())

    def _record(self, stage: str, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        named = batch if isinstance(batch, dict) else {self.loaders if stage == "train" else str(dataloader_idx): batch}
        for name, part in named.items():
            if stage == "val" and self.loaders == "both":
                name = ("torch", "remote")[dataloader_idx]
            elif stage == "val":
                name = self.loaders
            self.seen.append({
                "stage": "sanity" if self.trainer.sanity_checking else stage,
                "epoch": self.current_epoch,
                "batch": batch_idx,
                "loader": name,
                **describe(part),
            })

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._record("train", batch, batch_idx)
        first = batch["torch"] if isinstance(batch, dict) else batch
        return self.layer(first[0]).mean()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._record("val", batch, batch_idx, dataloader_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("address")
    parser.add_argument("devices", type=int)
    parser.add_argument("loaders", choices=("torch", "remote", "both"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--ckpt-dir")
    parser.add_argument("--resume")
    parser.add_argument("--val-generator", action="store_true")
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()

    L.seed_everything(SEED)
    model = LitSquares(args.address, args.loaders, args.val_generator)
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename="stop", every_n_train_steps=args.max_steps, save_top_k=-1))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        strategy="ddp" if args.devices > 1 else "auto",
        devices=args.devices,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(Path(args.out).parent),
    )
    trainer.fit(model, ckpt_path=args.resume)
    Path(f"{args.out}.rank{trainer.global_rank}.json").write_text(json.dumps(model.seen))


if __name__ == "__main__":
    main()
