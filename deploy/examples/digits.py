"""What the examples share: the model, one training epoch, and validation accuracy.

The examples train on ``digits-train`` and validate on ``digits-val``, the
handwritten digits that ``deploy/ds.yaml`` serves (``Digits`` in
``deploy/example_datasets.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

import torch


def arguments(description: str, epochs: int = 5) -> argparse.ArgumentParser:
    """The options every example takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument(
        "--address", default=None, help="the daemon (default: $LOADERD_ADDRESS, else unix:///tmp/loaderd.sock)"
    )
    return parser


def make_model() -> torch.nn.Module:
    """A small MLP over the 8x8 images, seeded so that runs compare."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def make_optimizer(model: torch.nn.Module, lr: float = 0.05) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor) -> float:
    """One optimizer step; the batch's summed loss."""
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item() * len(labels)


def train_epoch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """One pass over ``batches``; the mean training loss."""
    model.train()
    total, seen = 0.0, 0
    for images, labels in batches:
        total += train_step(model, optimizer, images, labels)
        seen += len(labels)
    return total / max(seen, 1)


@torch.no_grad()
def accuracy(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The fraction of ``batches``' images the model labels right."""
    model.eval()
    right = seen = 0
    for images, labels in batches:
        right += int((model(images).argmax(1) == labels).sum())
        seen += len(labels)
    return right / max(seen, 1)
