"""Benchmark: the item cache across a restart (disk tier) and over a dataset twice its size (memory tier).

    pip install -e '.[bench]'
    python tests/bench/bench_cache.py [--images 1024] [--workers 2] [--rounds 3] [--epochs 4] [--quick]

The pipeline is bench_images.py's ``--pipeline cached``: the dataset (``image_datasets:JpegResized``)
decodes a JPEG and resizes it deterministically, the ``transform:`` (``augment_resized``) crops,
flips and normalises at random. One trainer in this process reads every batch in full
(``torch.aminmax``); batch 64, shuffle; the daemon has ``--workers`` workers, torch's DataLoader
as many (persistent).

Restart: daemon A, with a disk tier in a fresh directory, runs two epochs (the first computes
and stores every item, the second reads them back) and stops; daemon B starts on the same
directory. Reported: B's start to SERVING, SERVING to its first batch, and B's first epoch's
images/s beside A's two and torch's. The store's file is in the page cache (A just wrote it);
a cold disk adds its read time to B's first epoch.

Twice the cache: a memory tier bounded to about half the items. The cache keeps what fits and
evicts nothing (a stable subset); per epoch (each a new shuffle) the hit rate the daemon counts,
beside what an LRU cache holding as many items would hit over the same indices in the same order
(simulated: the loader's order is torch's RandomSampler's with the same generator), and images/s.

Rounds interleave torch and loaderd; medians. Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from bench_loaders import Daemon, machine_line, median, run_guarded, start_daemon, wait_serving  # noqa: E402 - a script: sys.path first
from image_datasets import RESIZED, JpegImages, JpegResizedAugmented  # noqa: E402 - a script: sys.path first

from loaderd import RemoteDataLoader  # noqa: E402 - after the bench modules, which set up nothing it needs

BATCH = 64
STARTUP_TIMEOUT_S = 120.0
ITEM_BYTES = 3 * RESIZED * RESIZED


def log(message: str) -> None:
    print(f"[cache] {message}", file=sys.stderr, flush=True)


@dataclass
class Epoch:
    images_s: float
    first_batch_s: float  # from the epoch's iter() to its first batch
    hits: int = 0
    misses: int = 0


@dataclass
class Round:
    torch: list[Epoch] = field(default_factory=list)
    first: list[Epoch] = field(default_factory=list)  # daemon A: computes, then reads back
    restarted: list[Epoch] = field(default_factory=list)  # daemon B on A's disk tier
    to_serving_s: float = 0.0
    half: list[Epoch] = field(default_factory=list)  # the memory tier that holds about half
    half_items: int = 0
    lru: list[float] = field(default_factory=list)  # LRU's hit rate per epoch over the same order


def read_epoch(loader: Any) -> Epoch:
    """One epoch, every batch read in full; images/s from the first batch's arrival to the last's."""
    started = time.monotonic()
    images, first, last = 0, 0.0, 0.0
    for batch in loader:
        now = time.monotonic()
        if not first:
            first = now
        else:
            images += len(batch[0])
        torch.aminmax(batch[0])
        last = now
    return Epoch(images / (last - first), first - started)


def counts(daemon: Daemon) -> tuple[int, int, int]:
    """The daemon's cache counters for "img": (hits, misses, items)."""
    import grpc

    from loaderd.v1 import loaderd_pb2 as pb
    from loaderd.v1 import loaderd_pb2_grpc

    with grpc.insecure_channel(daemon.unix_address) as channel:
        reply = loaderd_pb2_grpc.LoaderStub(channel).Status(pb.StatusRequest(), timeout=10)
    cache = next(d.cache for d in reply.datasets if d.info.name == "img")
    return cache.hits, cache.misses, cache.items


def counted_epoch(loader: Any, daemon: Daemon) -> Epoch:
    before = counts(daemon)
    epoch = read_epoch(loader)
    after = counts(daemon)
    epoch.hits, epoch.misses = after[0] - before[0], after[1] - before[1]
    return epoch


def image_config(n: int, cache: dict[str, Any]) -> dict[str, Any]:
    return {"img": {"dataset": "image_datasets:JpegResized", "kwargs": {"n": n, "seed": 0},
                    "transform": "image_datasets:augment_resized", "cache": cache}}  # fmt: skip


class Running:
    """Daemons this bench started (the watchdog's cleanup stops what is left)."""

    def __init__(self) -> None:
        self.daemons: list[Daemon] = []

    def start(self, workers: int, datasets: dict[str, Any]) -> Daemon:
        daemon = start_daemon(workers, datasets)
        self.daemons.append(daemon)
        wait_serving(daemon, STARTUP_TIMEOUT_S)
        return daemon

    def stop(self, daemon: Daemon) -> None:
        self.daemons.remove(daemon)
        _, problem = daemon.stop()
        if problem:
            raise RuntimeError(f"daemon: {problem}\n{daemon.log()[-3000:]}")

    def stop_all(self) -> None:
        for daemon in list(self.daemons):
            self.daemons.remove(daemon)
            daemon.stop()


def loader_for(daemon: Daemon, seed: int) -> RemoteDataLoader:
    return RemoteDataLoader("img", batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed), address=daemon.unix_address)


def torch_epochs(args: argparse.Namespace, epochs: int) -> list[Epoch]:
    loader = DataLoader(JpegResizedAugmented(args.images, 0), batch_size=BATCH, shuffle=True, num_workers=args.workers,
                        persistent_workers=True, prefetch_factor=2)  # fmt: skip
    try:
        return [read_epoch(loader) for _ in range(epochs)]
    finally:
        del loader


def lru_hit_rates(n: int, capacity: int, seed: int, epochs: int) -> list[float]:
    """An LRU cache of ``capacity`` items over the loader's indices (RandomSampler with the same generator), per epoch."""
    sampler = RandomSampler(range(n), generator=torch.Generator().manual_seed(seed))
    held: collections.OrderedDict[int, None] = collections.OrderedDict()
    rates = []
    for _ in range(epochs):
        hits = 0
        for i in sampler:
            if i in held:
                hits += 1
                held.move_to_end(i)
            else:
                held[i] = None
                if len(held) > capacity:
                    held.popitem(last=False)
        rates.append(hits / n)
    return rates


def one_round(args: argparse.Namespace, rnd: int, running: Running) -> Round:
    out = Round()
    tmp = Path(tempfile.mkdtemp(prefix="ldb-cache-", dir="/tmp"))
    try:
        kinds = ["torch", "loaderd"] if rnd % 2 == 0 else ["loaderd", "torch"]
        for kind in kinds:
            if kind == "torch":
                out.torch = torch_epochs(args, 2)
                log(f"round {rnd + 1}: torch {', '.join(f'{e.images_s:.0f}' for e in out.torch)} images/s")
                continue
            disk = image_config(args.images, {"disk": str(tmp / "cache"), "max": int(1.3 * args.images * ITEM_BYTES)})
            first = running.start(args.workers, disk)
            loader = loader_for(first, rnd)
            out.first = [counted_epoch(loader, first) for _ in range(2)]
            del loader
            running.stop(first)
            started = time.monotonic()
            restarted = running.start(args.workers, disk)
            out.to_serving_s = time.monotonic() - started
            loader = loader_for(restarted, rnd)
            out.restarted = [counted_epoch(loader, restarted) for _ in range(2)]
            del loader
            running.stop(restarted)
            log(f"round {rnd + 1}: disk tier: daemon A {', '.join(f'{e.images_s:.0f}' for e in out.first)} images/s; "
                f"restarted B SERVING after {out.to_serving_s:.1f} s, first batch {out.restarted[0].first_batch_s:.2f} s later, "
                f"{', '.join(f'{e.images_s:.0f}' for e in out.restarted)} images/s ({out.restarted[0].misses} misses)")  # fmt: skip
            half = running.start(args.workers, image_config(args.images, {"memory": args.images * ITEM_BYTES // 2}))
            seed = 1000 + rnd
            loader = loader_for(half, seed)
            out.half = [counted_epoch(loader, half) for _ in range(args.epochs)]
            del loader
            out.half_items = counts(half)[2]
            running.stop(half)
            out.lru = lru_hit_rates(args.images, out.half_items, seed, args.epochs)
            log(f"round {rnd + 1}: half-size cache holds {out.half_items} of {args.images} items; hit rates "
                f"{', '.join(f'{e.hits / max(1, e.hits + e.misses):.0%}' for e in out.half)} (LRU of as many items: "
                f"{', '.join(f'{r:.0%}' for r in out.lru)})")  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _med(values: Iterator[float]) -> float:
    return median(list(values))


def report(args: argparse.Namespace, rounds: list[Round], wall_s: float) -> None:
    p = print
    p("## The item cache across a restart and over a dataset twice its size (tests/bench/bench_cache.py)\n")
    p(f"- machine: {machine_line()}")
    p(f"- {args.images} JPEGs, bench_images.py's cached pipeline (decode + resize to {RESIZED}x{RESIZED} cached; random crop, "
      f"flip, normalise in the transform); batch {BATCH}, shuffle; {args.workers} workers (torch: num_workers={args.workers}, "
      f"persistent); one trainer reading every batch in full; {args.rounds} rounds, medians; wall time {wall_s:.0f} s\n")  # fmt: skip
    p("### Restart on the disk tier\n")
    p("| | images/s (epoch 1) | images/s (epoch 2) |")
    p("| --- | ---: | ---: |")
    p(f"| torch DataLoader | {_med(r.torch[0].images_s for r in rounds):.0f} | {_med(r.torch[1].images_s for r in rounds):.0f} |")
    p(f"| daemon A, empty disk tier | {_med(r.first[0].images_s for r in rounds):.0f} | {_med(r.first[1].images_s for r in rounds):.0f} |")
    p(f"| daemon B, restarted on A's disk tier | {_med(r.restarted[0].images_s for r in rounds):.0f} | "
      f"{_med(r.restarted[1].images_s for r in rounds):.0f} |")  # fmt: skip
    ratio = _med(r.restarted[0].images_s / r.first[1].images_s for r in rounds)
    p(f"\nDaemon B: SERVING {_med(r.to_serving_s for r in rounds):.1f} s after its start; its first batch came "
      f"{_med(r.restarted[0].first_batch_s for r in rounds):.2f} s after the trainer, started then, asked for it; its first epoch ran at "
      f"{ratio:.2f}x daemon A's cached epoch, with {_med(r.restarted[0].misses for r in rounds):.0f} misses "
      f"(items computed) of {args.images}.\n")  # fmt: skip
    p("### A dataset twice the cache (memory tier bounded to half the items' bytes)\n")
    p("| epoch | hit rate: loaderd (keeps a stable subset) | hit rate: LRU of as many items, same order | loaderd images/s |")
    p("| ---: | ---: | ---: | ---: |")
    for e in range(args.epochs):
        ours = _med(r.half[e].hits / max(1, r.half[e].hits + r.half[e].misses) for r in rounds)
        p(f"| {e + 1} | {ours:.0%} | {_med(r.lru[e] for r in rounds):.0%} | {_med(r.half[e].images_s for r in rounds):.0f} |")
    p(f"\nThe cache held {_med(r.half_items for r in rounds):.0f} of {args.images} items. torch's DataLoader in the same rounds: "
      f"{_med(r.torch[1].images_s for r in rounds):.0f} images/s.")  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=1024, help="distinct JPEGs (the dataset)")
    parser.add_argument("--workers", type=int, default=2, help="the daemon's pool, and torch's num_workers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4, help="epochs over the half-size cache")
    parser.add_argument("--quick", action="store_true", help="smoke test: 256 images, 1 round, 3 epochs")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.rounds, args.epochs = 256, 1, 3
    log(f"making or reading the {args.images} JPEGs")
    JpegImages(args.images, 0)
    running = Running()
    started = time.perf_counter()

    def body() -> int:
        rounds = [one_round(args, rnd, running) for rnd in range(args.rounds)]
        report(args, rounds, time.perf_counter() - started)
        return 0

    return run_guarded(600 + args.rounds * 600, body, running.stop_all)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
