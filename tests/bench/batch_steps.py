"""loaderd's own per-batch steps for one f32 batch in shared memory, timed on one thread (bench_limits.py section 5).

The steps that stay whatever carries a batch between processes: a task pickled and unpickled, the batch's seeding,
its layout encoded, its result pickled and unpickled, the slot handle framed, the client's tensors made over the
slot. Each is timed alone (over and over: its code and data in the caches) and, for the steps a pool worker runs,
once right after a batch's gather, as a worker runs them: the gather reads 12.6 MB of random items of a 400 MB
dataset, so what runs next finds the core's L1 and L2 caches (2-4 MiB) holding the batch, not the step's code and
data. A control reads a tensor of a batch's size instead (a sum: no gather, no stores): where the two match, the
steps pay for refilling the caches, not for anything else of the gather's.

Imported by bench_limits.py and bench_travel.py (this is a script's module, not a package's).
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import pickle
import queue
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import bench_loaders as bl
import torch

SHAPE = (3, 64, 64)
BATCH = 256
ITEMS = bl.DATASETS["f32"]["n"]
NBYTES = BATCH * SHAPE[0] * SHAPE[1] * SHAPE[2] * 4  # an f32 batch's payload
TASK_INDICES = tuple(range(0, BATCH * 31, 31))  # a task's indices (bench_travel.py sends the same)
POOL_SLOTS = 4  # slots a pool worker cycles through at the default window (4 batches per worker)
# The steps a pool worker runs (a task's unpickling, the result's pickling): timed after a gather too.
WORKER_STEPS = ("task", "seed", "encode", "result")
AFTER_GATHER_REPEAT = 150  # gathers, each followed by one timed call of a step
_WAIT_S = 300.0


class StepCosts(NamedTuple):
    """CPU ms per step (medians of single timed calls)."""

    alone: dict[str, float]
    after_gather: dict[str, float]  # WORKER_STEPS only; empty if not measured
    after_read: dict[str, float]  # the control: after a read of a batch's bytes; empty if not measured


def _steps() -> dict[str, Callable[[], Any]]:
    from loaderd.server.scheduling.stream import fetch_task
    from loaderd.server.shm.arena import SlotRef
    from loaderd.server.worker.seeding import seed_everything
    from loaderd.server.worker.tasks import BatchDone
    from loaderd.v1 import loaderd_pb2 as pb
    from loaderd.wire.batch_decoder import view_batch
    from loaderd.wire.batch_encoder import encode_batch
    from loaderd.wire.framing import read_frame, slot_message

    segment = mmap.mmap(-1, NBYTES)  # as a worker's segment is mapped (the pages are not what is measured)
    slot = torch.frombuffer(segment, dtype=torch.uint8)
    batch = slot.view(torch.float32).view(BATCH, *SHAPE)  # collated into the slot, as a pool worker does
    value = encode_batch(batch, slot, NBYTES).value.SerializeToString()
    name = "loaderd-12345-0123456789abcdef-w0g0-17"
    done = BatchDone(stream_id=3, seq=17, value=value, payload_bytes=NBYTES, slot=SlotRef(name=name, size=NBYTES))
    task = fetch_task(3, "f32", 17, TASK_INDICES, True, 1234)
    handle = pb.SlotHandle(name=name, size=NBYTES, lease=12345).SerializeToString()
    raw = slot_message(17, value, NBYTES, handle)
    mapped = memoryview(segment)

    def released() -> None:
        pass

    def client_view() -> None:
        frame = read_frame(raw)
        assert frame.header is not None
        view = mapped[:NBYTES]
        weakref.finalize(view, released)  # as a lease's release is tied to the batch's tensors
        view_batch(frame.header, view)

    return {
        "task": lambda: pickle.loads(pickle.dumps(fetch_task(3, "f32", 17, TASK_INDICES, True, 1234))),
        "seed": lambda: seed_everything(task.seed),
        "encode": lambda: encode_batch(batch, slot, NBYTES).value.SerializeToString(),
        "result": lambda: pickle.loads(pickle.dumps(done)),
        "frame": lambda: slot_message(17, value, NBYTES, pb.SlotHandle(name=name, size=NBYTES, lease=12345).SerializeToString()),
        "view": client_view,
    }  # the segment's mapping goes with the last tensor over it


def _timed(step: Callable[[], Any]) -> float:
    start = time.process_time()
    step()
    return time.process_time() - start


def _after(steps: dict[str, Callable[[], Any]], before: Callable[[int], Any]) -> dict[str, float]:
    """Each worker step timed once after each of ``AFTER_GATHER_REPEAT`` calls of ``before(n)``; CPU ms, medians."""
    costs: dict[str, float] = {}
    for key in WORKER_STEPS:
        times = []
        for n in range(AFTER_GATHER_REPEAT):
            before(n)
            times.append(_timed(steps[key]))
        costs[key] = 1000 * statistics.median(times)
    return costs


def _after_gathers(steps: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """After gathers of random items of the whole dataset into the next warm slot, as bench_limits' pool gather."""
    data = torch.ones((ITEMS, *SHAPE))
    slots = [torch.ones((BATCH, *SHAPE)) for _ in range(POOL_SLOTS)]
    generator = torch.Generator().manual_seed(os.getpid())

    def gather(n: int) -> None:
        indices = torch.randperm(ITEMS, generator=generator)[:BATCH].tolist()
        torch.stack([data[i] for i in indices], 0, out=slots[n % POOL_SLOTS])

    return _after(steps, gather)


def _after_reads(steps: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """After reads of a batch's bytes (a sum over the next of the warm slots)."""
    slots = [torch.ones((BATCH, *SHAPE)) for _ in range(POOL_SLOTS)]
    return _after(steps, lambda n: slots[n % POOL_SLOTS].sum())


def measure(repeat: int, after_gather: bool) -> StepCosts:
    """The steps' costs in this process: alone, and (``after_gather``) after gathers and after the control's reads."""
    torch.set_num_threads(1)
    steps = _steps()
    alone: dict[str, float] = {}
    for key, step in steps.items():
        for _ in range(repeat // 10):  # warm
            step()
        alone[key] = 1000 * statistics.median(_timed(step) for _ in range(repeat))
    if not after_gather:
        return StepCosts(alone, {}, {})
    return StepCosts(alone, _after_gathers(steps), _after_reads(steps))


def _measure_into(results: Any, repeat: int) -> None:
    results.put(measure(repeat, after_gather=True))


def start_as_pool_workers(processes: list[Any]) -> None:
    """Start ``processes`` (spawned) with the ``GLIBC_TUNABLES`` the pool's fork server starts with (its workers'
    copies bypass the caches: server/process/glibc_tunables.py); this process's own setting is put back after."""
    from loaderd.server.process import glibc_tunables

    original = os.environ.get(glibc_tunables.VARIABLE)
    tunables = glibc_tunables.fork_server_value(original)
    try:
        if tunables is not None:
            os.environ[glibc_tunables.VARIABLE] = tunables
        for process in processes:
            process.start()
    finally:
        glibc_tunables.restore(original)


def per_batch_work_ms(repeat: int = 3000, after_gather: bool = True) -> StepCosts:
    """The steps' costs. With ``after_gather``, from a process started as the pool's fork server is (its
    ``GLIBC_TUNABLES``: a worker's copies bypass the caches, server/process/glibc_tunables.py); else here, alone."""
    if not after_gather:
        return measure(repeat, after_gather=False)
    ctx = multiprocessing.get_context("spawn")  # glibc reads its tunables when a process starts
    results = ctx.Queue()
    process = ctx.Process(target=_measure_into, args=(results, repeat), daemon=True)
    start_as_pool_workers([process])
    deadline = time.monotonic() + _WAIT_S
    try:
        while True:
            try:
                costs: StepCosts = results.get(timeout=1.0)
                return costs
            except queue.Empty:
                if not process.is_alive():
                    try:  # it may have put its figures and left between the two checks
                        late: StepCosts = results.get(timeout=1.0)
                        return late
                    except queue.Empty:
                        raise RuntimeError(f"measuring the per-batch steps failed (exit code {process.exitcode})") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"measuring the per-batch steps took over {_WAIT_S:g} s") from None
    finally:
        if process.is_alive():
            process.kill()
        process.join(5)
