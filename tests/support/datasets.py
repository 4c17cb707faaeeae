"""Datasets the tests' daemon configs name (importable from the tests/ directory).

Each is cheap and deterministic; the same classes are built locally to feed
torch's DataLoader as the oracle.
"""

from __future__ import annotations

import collections
import importlib
import logging
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

Pair = collections.namedtuple("Pair", ["left", "right"])


class Squares(Dataset):
    """Item i is (tensor([i, i*i]) float32, i)."""

    def __init__(self, n: int = 100) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not -self.n <= i < self.n:
            raise IndexError(f"Squares index {i} out of range for {self.n} items")
        i %= self.n
        return torch.tensor([i, i * i], dtype=torch.float32), i


class Structured(Dataset):
    """Nested samples: dicts, lists, tuples, namedtuples, strings, numpy arrays and scalars."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "image": torch.full((3, 4, 5), float(i), dtype=torch.float16),
            "array": np.arange(6, dtype=np.int32).reshape(2, 3) + i,
            "label": i % 7,
            "weight": i / 3.0,
            "flag": bool(i % 2),
            "name": f"item-{i}",
            "pair": Pair(torch.tensor(i), np.float64(i) / 2),
            "nested": {"list": [i, torch.ones(2, dtype=torch.bool)], "tuple": (i * 2, f"t{i}")},
            "bytes": bytes([i % 256]) * 3,
        }


class RandomAugment(Dataset):
    """Random transforms from torch, numpy and random inside __getitem__."""

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "index": i,
            "torch": torch.rand(3),
            "numpy": np.random.rand(2),
            "random": random.random(),
        }


class WorkerAware(Dataset):
    """Reports get_worker_info() from inside __getitem__."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, int]:
        info = get_worker_info()
        return {"index": i, "has_info": info is not None, "pid": os.getpid()}


class Failing(Dataset):
    """Raises a chosen exception on chosen indices."""

    def __init__(self, n: int = 20, bad: tuple[int, ...] = (5,), kind: str = "ValueError") -> None:
        self.n = n
        self.bad = set(bad)
        self.kind = kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.bad:
            if self.kind == "KeyError":
                raise KeyError(f"no key for {i}")
            if self.kind == "Custom":
                raise CustomError(f"custom failure at {i}")
            raise ValueError(f"bad item {i}")
        return i


class CustomError(Exception):
    pass


class Slow(Dataset):
    """Sleeps ``delay`` seconds per item (for timeout and cancellation tests)."""

    def __init__(self, n: int = 1000, delay: float = 0.05) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.delay)
        return i


class Gated(Dataset):
    """Item i is (``width`` float32 values i, i + 1, ..., i), but item ``gated`` waits until the file ``gate`` exists
    (at most ``timeout_s``, then raises): the batches after its batch are made meanwhile and wait, ready, behind it."""

    def __init__(self, n: int = 40, gate: str = "", gated: int = 0, width: int = 2, timeout_s: float = 60.0) -> None:
        self.n = n
        self.gate = gate
        self.gated = gated
        self.width = width
        self.timeout_s = timeout_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == self.gated:
            deadline = time.monotonic() + self.timeout_s
            while not os.path.exists(self.gate):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the gate {self.gate} did not open within {self.timeout_s} s")
                time.sleep(0.01)
        return torch.arange(i, i + self.width, dtype=torch.float32), i


class KillOnce(Dataset):
    """SIGKILLs its own worker the first time it fetches ``victim`` (marker file makes it once)."""

    def __init__(self, n: int = 60, victim: int = 17, marker: str = "") -> None:
        self.n = n
        self.victim = victim
        self.marker = marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.victim and self.marker and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([i])


class AlwaysCrash(Dataset):
    """Segfault-like death on one index, every time."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        if i == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return i


class Stream(IterableDataset):
    """range(n), sharded over workers with get_worker_info() as torch's docs show."""

    def __init__(self, n: int = 50) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        if info is None:
            yield from ({"x": i, "wid": -1} for i in range(self.n))
            return
        for i in range(info.id, self.n, info.num_workers):
            yield {"x": i, "wid": info.id}


class UnevenStream(IterableDataset):
    """Worker w yields (w + 1) * 3 items: replicas run dry at different times."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        wid = -1 if info is None else info.id
        count = 5 if info is None else (info.id + 1) * 3
        for i in range(count):
            yield torch.tensor([wid, i])


class SizedStream(Stream):
    def __len__(self) -> int:
        return self.n


def sum_collate(batch: list[Any]) -> dict[str, Any]:
    """A config collate_fn: sums a batch of Squares items."""
    xs = torch.stack([x for x, _ in batch])
    return {"sum": xs.sum(0), "count": len(batch), "pid": os.getpid()}


def broken_factory() -> Dataset:
    raise RuntimeError("factory exploded on purpose")


def record_init(worker_id: int) -> None:
    """A worker_init_fn that leaves a trace the dataset can report."""
    os.environ["LOADERD_TEST_INIT"] = str(worker_id)


class InitAware(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> str:
        return os.environ.get("LOADERD_TEST_INIT", "none")


class UnevenRandomStream(IterableDataset):
    """Replica w yields (w + 1) * ``per_replica`` items with random values (torch, numpy, random).

    Replicas run dry at different times, and every item depends on the RNG
    state of its replica, so a resumed stream must replay them exactly.
    """

    def __init__(self, per_replica: int = 5) -> None:
        self.per_replica = per_replica

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        wid = -1 if info is None else info.id
        count = 2 * self.per_replica if info is None else (info.id + 1) * self.per_replica
        for i in range(count):
            yield {"wid": wid, "i": i, "torch": torch.rand(2), "numpy": np.random.rand(), "random": random.random()}


class Hang(Dataset):
    """Item ``at`` never returns (a hung ``__getitem__``); the others are tensors."""

    def __init__(self, n: int = 12, at: int = 5) -> None:
        self.n = n
        self.at = at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.at:
            time.sleep(3600)
        return torch.tensor([i])


class ExitOn(Dataset):
    """Item ``at`` raises SystemExit: the worker leaves through Python, running its finally blocks."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 3:
            raise SystemExit(3)
        return i


class LenFails(Dataset):
    """A dataset whose ``__len__`` raises."""

    def __len__(self) -> int:
        raise ValueError("cannot count my items")

    def __getitem__(self, i: int) -> int:
        return i


class Shouty(Dataset):
    """Raises with a 10 MB message on odd items, returns a 40 MiB Python structure on item 2."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        if i % 2:
            raise ValueError("x" * 10_000_000)
        if i == 2:
            return ["y" * (1 << 20)] * 40
        return torch.tensor([i])


def deep_collate(batch: list[Any]) -> Any:
    """A collate_fn whose result is too deep for the codec (it raises RecursionError there, not TypeError)."""
    if batch[0][1] != 1:
        return torch.utils.data.default_collate(batch)
    nested: list[Any] = []
    for _ in range(5000):
        nested = [nested]
    return nested


class Blocks(Dataset):
    """Item i is a 128 KiB float32 tensor full of i: over the inline threshold, so each batch is a slot."""

    def __init__(self, n: int = 300) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((32768,), float(i))


class Recorded(Dataset):
    """Squares that remember which process built them, holding ``mb`` MB of numpy data (every page written).

    ``padding`` stands for bulky constructor arguments (e.g. a list of file names).

    Each construction appends the building pid to the file ``record``.
    """

    def __init__(self, n: int, record: str, mb: int = 0, padding: list[str] | None = None) -> None:
        self.n = n
        self.padding = len(padding or ())  # bulky kwargs (a file list); only counted
        self.built_in = os.getpid()
        self.blob = np.full(mb * 2**20 // 8, 7, dtype=np.int64)
        with open(record, "a") as f:
            f.write(f"{self.built_in}\n")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"square": torch.tensor(i * i), "built_in": self.built_in, "worker": os.getpid()}


def hang_on_build() -> Dataset:
    """A constructor that never returns."""
    time.sleep(3600)
    raise AssertionError("unreachable")


class HangIfMarked(Squares):
    """Squares whose constructor never returns if ``marker`` exists; it takes the marker, so one start hangs."""

    def __init__(self, n: int, marker: str) -> None:
        try:
            os.unlink(marker)
        except FileNotFoundError:
            super().__init__(n)
            return
        time.sleep(3600)


def stream_unless_marked(n: int, marker: str) -> IterableDataset:
    """A Stream whose construction fails while ``marker`` exists (a worker slot that cannot start)."""
    if os.path.exists(marker):
        raise RuntimeError(f"{marker} exists")
    return Stream(n)


def exit_on_build() -> Dataset:
    """A constructor that ends its process without Python's cleanup (as the OOM killer would)."""
    os._exit(3)


class Chatty(Squares):
    """Squares that logs a warning from its constructor (in each pool worker): worker log lines in tests."""

    def __init__(self, n: int = 100) -> None:
        super().__init__(n)
        logging.getLogger("chatty").warning("built %d squares in pid %d", n, os.getpid())


class TunablesSeen(Dataset):
    """Item i is the value ``GLIBC_TUNABLES`` gives ``names[i]`` in the process running ``__getitem__``
    (-1: unset): as its C library read it at start (``source="start"``: the environment the process
    was exec'd with, which a forked one shares with its parent) or as it would pass it on (``"environ"``)."""

    def __init__(self, names: list[str], source: str) -> None:
        self.names = names
        self.source = source

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> torch.Tensor:
        from loaderd.server.process.glibc_tunables import VARIABLE, parse

        if self.source == "start":
            with open("/proc/self/environ", "rb") as f:
                initial = dict(entry.partition(b"=")[::2] for entry in f.read().split(b"\0") if entry)
            value = initial.get(VARIABLE.encode())
            current = value.decode() if value is not None else None
        else:
            current = os.environ.get(VARIABLE)
        setting = parse(current).get(self.names[i])
        return torch.tensor(-1 if setting is None else int(setting, 0))


class ModulesSeen(Dataset):
    """Item i is 1.0 if ``modules[i]`` is imported in the process running ``__getitem__``, else 0.0."""

    def __init__(self, modules: list[str]) -> None:
        self.modules = modules

    def __len__(self) -> int:
        return len(self.modules)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(float(self.modules[i] in sys.modules))


class Records(Dataset):
    """Item i is a dict, as a transformers Trainer's model takes it: {"x": tensor([i, i*i]) float32,
    "labels": tensor(i % 3) float32, "index": i}."""

    def __init__(self, n: int = 100) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(f"Records index {i} out of range for {self.n} items")
        return {"x": torch.tensor([i, i * i], dtype=torch.float32), "labels": torch.tensor(float(i % 3)), "index": i}


class Rendezvous(Dataset):
    """Item i is ``i``, returned once ``parties`` items of the worker wait together: a worker's item threads
    (``threads:``) must run items side by side, or the barrier times out and the item raises BrokenBarrierError."""

    def __init__(self, n: int = 64, parties: int = 2, timeout: float = 10.0) -> None:
        self.n, self.parties, self.timeout = n, parties, timeout
        self.barrier = threading.Barrier(parties)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.barrier.wait(self.timeout)
        return i


class ThreadNames(Squares):
    """Squares that records which thread fetched each item (``threads``); with ``parties`` > 1 items wait at a
    barrier for that many, so that several threads surely take part (for the unit tests)."""

    def __init__(self, n: int = 100, parties: int = 1) -> None:
        super().__init__(n)
        self.threads: dict[int, str] = {}
        self.barrier = threading.Barrier(parties)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.threads[i] = threading.current_thread().name
        self.barrier.wait(10)
        return super().__getitem__(i)


class CrossBatch(Squares):
    """Squares whose item ``hold`` waits (up to ``timeout`` s) until item ``until`` has started, and raises if it
    never does; each item records the seed ``get_worker_info()`` shows it (``seeds``). With ``until`` in the batch
    after ``hold``'s, only a worker that starts the next batch's items while it finishes one gets through (the unit
    tests of a worker's run-ahead)."""

    def __init__(self, n: int = 100, hold: int = 0, until: int = -1, timeout: float = 10.0) -> None:
        super().__init__(n)
        self.hold, self.until, self.timeout = hold, until, timeout
        self.reached = threading.Event()
        self.seeds: dict[int, list[int | None]] = collections.defaultdict(list)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        info = get_worker_info()
        self.seeds[i].append(None if info is None else info.seed)
        if i == self.until:
            self.reached.set()
        if i == self.hold and not self.reached.wait(self.timeout):
            raise TimeoutError(f"item {self.until} never started while item {i} waited")
        return super().__getitem__(i)


class BatchFetch(Squares):
    """Squares with ``__getitems__``: records each call's indices in ``calls``; ``returns`` says what it gives back:
    "list" (torch's contract), "generator" (of the items), or "dict" (a batch of its own: {"i": tensor of indices})."""

    def __init__(self, n: int = 100, returns: str = "list") -> None:
        super().__init__(n)
        self.calls: list[list[int]] = []
        self.returns = returns

    def __getitems__(self, indices: list[int]) -> Any:
        self.calls.append(list(indices))
        if self.returns == "dict":
            return {"i": torch.tensor(indices)}
        items = (self[i] for i in indices)
        return items if self.returns == "generator" else list(items)


def double_first(item: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
    """A ``transform:``: a Squares item with its tensor doubled (a new tensor: the item is left as it was)."""
    tensor, label = item
    return tensor * 2, label


def square_x(item: dict[str, int]) -> dict[str, int]:
    """A ``transform:`` for Stream's items: ``x`` squared."""
    return {**item, "x": item["x"] ** 2}


class ImportsLazily(Squares):
    """Squares whose constructor imports ``module`` (as a dataset importing torchvision in ``__init__`` does)."""

    def __init__(self, n: int = 10, module: str = "yaml") -> None:
        super().__init__(n)
        importlib.import_module(module)


CALLS: list[str] = []  # what CallLog and log_transform did, in order (this process's)


class CallLog(Squares):
    """Squares that appends ``get i`` to ``CALLS`` for each item fetched."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        CALLS.append(f"get {i}")
        return super().__getitem__(i)


def log_transform(item: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
    """A ``transform:`` that appends ``transform`` to ``CALLS``."""
    CALLS.append("transform")
    return item
