"""What carrying a batch between processes costs, by how many batches travel together (issue 42, target 1).

    python tests/bench/bench_travel.py [--groups 1,2,4] [--paths direct,relay] [--rounds 3] [--seconds 5] [--work-ms 0] [--quick]

A prototype of the same-host control path, built from loaderd's own per-batch steps and
nothing else: no gRPC, no scheduler, no threads, no gather (the batch's own work is not what
is measured). A client (this process) and a pool worker (spawned) exchange, over a
multiprocessing pipe (two, with a relay between them):

- client to worker: tasks (``FetchTask``, 256 indices, as the daemon makes them) ``group`` at a
  time in one message, with the leases of the slots the client's batches let go of since the
  last one (as a plan message carries them);
- worker, per batch: the generators seeded, the layout of a batch lying in one of its
  shared-memory segments (/dev/shm, 8 of them, 12.6 MB each: the f32 workload; nothing is
  written into them) encoded, the slot handle framed (``slot_message``); the frames of one task message go back in
  one message;
- client, per batch: the frame read, the segment mapped (once), the batch's tensors made over
  it with the release tied to them (``weakref.finalize``, as ``ShmSession.lease_view`` does),
  the batch dropped.

With ``--work-ms N`` the worker spends N ms of CPU a batch (a loop: the batch's own work, taken off the
figures again): the client then waits for batches as a trainer does, and a window of batches queues up.

``relay`` puts a third process between them (the daemon's place), which unpickles each message
and pickles it on (the least a daemon's round can do). The client keeps a window of 8 batches
asked for. Per path and group: the CPU ms a batch of all the processes, the wake-ups a batch (voluntary
context switches of every thread), and beside them the same steps run alone on one thread (bench_limits
section 5, which also counts a result's pickling that the prototype does not do): what is left is, roughly,
the travel. A group divides the window and is below it. Rounds interleave the paths and groups; medians. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
import weakref
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import bench_limits  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)
import bench_loaders as bl  # noqa: E402 - imported once sys.path holds what it needs (this is a script, not a package)

from loaderd.server.scheduling.stream import fetch_task  # noqa: E402 - with the bench modules, once sys.path is set
from loaderd.server.shm.arena import unlink_segments  # noqa: E402
from loaderd.wire.batch_decoder import view_batch  # noqa: E402
from loaderd.wire.framing import read_frame, slot_message  # noqa: E402
from loaderd.wire.limits import SHM_DIR  # noqa: E402
from loaderd.wire.mapping import map_fd  # noqa: E402

SHAPE = bench_limits.SHAPE
BATCH = bench_limits.BATCH
NBYTES = bench_limits.NBYTES
WINDOW = 8  # batches asked for and not yet received, as a loader's default window with 2 workers
SEGMENT = "loaderd-bench-travel-"
START_TIMEOUT_S = 120.0  # a spawned worker imports torch and makes its segments
ANSWER_TIMEOUT_S = 30.0  # a message's batches take milliseconds


def _worker(conn: Connection, prefix: str, slots: int, work_s: float) -> None:
    """The pool worker's part (spawned): make each task's batch in a free segment, answer with the frames."""
    import torch

    from loaderd.server.worker.seeding import seed_everything
    from loaderd.v1 import loaderd_pb2 as pb
    from loaderd.wire.batch_encoder import encode_batch

    names = [f"{prefix}{i}" for i in range(slots)]
    bases: list[torch.Tensor] = []
    try:
        for name in names:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, NBYTES)
                bases.append(torch.frombuffer(map_fd(fd, NBYTES, writable=True), dtype=torch.uint8))
            finally:
                os.close(fd)
        # Where a pool worker's collation leaves a batch (nothing is written: the bytes are not what is measured).
        batches = [base.view(torch.float32).view(BATCH, *SHAPE) for base in bases]
        free = list(range(slots))
        conn.send(names)
        while (message := conn.recv()) is not None:
            tasks, released = message
            free.extend(released)
            frames: list[bytes] = []
            for task in tasks:
                lease = free.pop()  # never empty: the client has at most the window out, one segment each
                if work_s:  # the batch's own work: CPU time of this thread, so that it can be taken off exactly
                    done_at = time.thread_time() + work_s
                    while time.thread_time() < done_at:
                        pass
                seed_everything(task.seed)
                value = encode_batch(batches[lease], bases[lease], NBYTES).value.SerializeToString()
                handle = pb.SlotHandle(name=names[lease], size=NBYTES, lease=lease).SerializeToString()
                frames.append(slot_message(task.seq, value, NBYTES, handle))
            conn.send(frames)
    finally:
        unlink_segments(prefix)


def _relay(client: Connection, worker: Connection) -> None:
    """The daemon's place (spawned): each message unpickled and pickled on, both ways, until the client's None."""
    while True:
        for ready in wait([client, worker]):
            message = ready.recv()
            (worker if ready is client else client).send(message)
            if message is None:
                return


class _Client:
    """This process's part: asks for batches ``group`` at a time, reads and drops them."""

    def __init__(self, conn: Connection, group: int) -> None:
        self._conn = conn
        self._group = group
        self._maps: dict[str, memoryview] = {}
        self._released: list[int] = []
        self._seq = 0
        self._out = 0  # batches asked for and not yet received

    def _ask(self) -> None:
        tasks = [fetch_task(1, "f32", self._seq + i, bench_limits.TASK_INDICES, True, 1234) for i in range(self._group)]
        self._seq += self._group
        self._out += self._group
        released, self._released = self._released, []
        self._conn.send((tasks, released))

    def _mapped(self, name: str) -> memoryview:
        mapping = self._maps.get(name)
        if mapping is None:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
            try:
                mapping = self._maps[name] = map_fd(fd, NBYTES, writable=True)  # as the client's SegmentMaps
            finally:
                os.close(fd)
        return mapping

    def read(self, batches: int) -> int:
        """Read at least ``batches`` batches, keeping the window full; returns how many."""
        got = 0
        while self._out + self._group <= WINDOW:
            self._ask()
        while got < batches:
            for raw in _received(self._conn, ANSWER_TIMEOUT_S):
                frame = read_frame(raw)
                header = frame.header
                assert header is not None and header.HasField("slot")
                view = self._mapped(header.slot.name)[: header.payload_bytes]
                weakref.finalize(view, self._released.append, header.slot.lease)
                batch = view_batch(header, view)
                del view, batch  # the trainer is done with it: its lease is released
                got += 1
                self._out -= 1
            while self._out + self._group <= WINDOW:
                self._ask()
        return got

    def drain(self) -> None:
        """Take what is still on its way, then end the processes' loops."""
        while self._out > 0:
            self._out -= len(_received(self._conn, ANSWER_TIMEOUT_S))
        self._conn.send(None)


def _received(conn: Connection, timeout: float) -> Any:
    """The next message on ``conn``; RuntimeError if none comes within ``timeout`` s, EOFError if the other side is gone."""
    if not conn.poll(timeout):
        raise RuntimeError(f"no answer from the worker within {timeout:g} s")
    return conn.recv()


def _snapshot(pids: list[int]) -> tuple[float, dict[int, dict[int, int]]]:
    """CPU seconds of ``pids`` (each process alone: none has children) and their threads' voluntary switches."""
    cpu = sum(bl.own_cpu_seconds(fields) for pid in pids if (fields := bl.proc_stat(pid)) is not None)
    return cpu, {pid: bl.thread_switches(pid) for pid in pids}


def trial(path: str, group: int, seconds: float, work_s: float) -> tuple[float, float, float]:
    """One trial: (CPU ms a batch of all processes less the worker's ``work_s``, wake-ups a batch, batches/s)."""
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    processes: list[multiprocessing.process.BaseProcess] = []
    others = [theirs]  # the ends the children hold; this process closes its copies
    if path == "relay":
        to_worker, at_worker = spawn.Pipe()
        processes.append(spawn.Process(target=_relay, args=(theirs, to_worker), daemon=True))
        theirs = at_worker
        others += [to_worker, at_worker]
    prefix = f"{SEGMENT}{os.getpid()}-{path}-{group}-"
    processes.append(spawn.Process(target=_worker, args=(theirs, prefix, WINDOW, work_s), daemon=True))
    for process in processes:
        process.start()
    for end in others:
        end.close()  # so that a child's death reaches this process as the end of its pipe
    try:
        _received(ours, START_TIMEOUT_S)  # the segments are made
        client = _Client(ours, group)
        client.read(200)  # warm-up: segments mapped, code paths warm
        pids = [os.getpid(), *(p.pid or 0 for p in processes)]
        cpu0, switches0 = _snapshot(pids)
        start = time.perf_counter()
        batches = 0
        while time.perf_counter() - start < seconds:
            batches += client.read(100)
        elapsed = time.perf_counter() - start
        cpu1, switches1 = _snapshot(pids)
        cpu = cpu1 - cpu0
        switches = sum(bl.switches_since(switches0.get(pid, {}), after) for pid, after in switches1.items())
        client.drain()
    finally:
        ours.close()  # the children read the end of their input and leave; the worker removes its segments
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join(5)
        unlink_segments(prefix)  # a killed worker's
    return 1000 * cpu / batches - 1000 * work_s, switches / batches, batches / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", default="1,2,4", help="batches per message, comma-separated (each divides the window of 8, below it)")
    parser.add_argument("--paths", default="direct,relay", help="direct (client and worker) and/or relay (a process between)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per trial (/proc counts CPU in 10 ms ticks)")
    parser.add_argument("--work-ms", type=float, default=0.0, help="CPU ms the worker spends a batch besides (its own work; not in the figures)")
    parser.add_argument("--quick", action="store_true", help="groups 1 and 4, 1 round of 0.3 s (a smoke run)")
    args = parser.parse_args()
    groups = [1, 4] if args.quick else [int(g) for g in args.groups.split(",")]
    paths = args.paths.split(",")
    rounds, seconds = (1, 0.3) if args.quick else (args.rounds, args.seconds)
    # A group that does not divide the window keeps fewer batches asked for; one of the whole window leaves the
    # worker idle while the client reads: either changes what is measured.
    if any(g < 1 or g >= WINDOW or WINDOW % g for g in groups) or any(p not in ("direct", "relay") for p in paths):
        parser.error(f"groups divide {WINDOW} and are below it (1, 2, 4); paths are direct and relay")
    floor = sum(bench_limits.per_batch_work_ms(after_gather=False).alone.values())
    results: dict[tuple[str, int], list[tuple[float, float, float]]] = {(p, g): [] for p in paths for g in groups}
    for r in range(rounds):
        keys = list(results) if r % 2 == 0 else list(reversed(results))
        for key in keys:
            results[key].append(trial(*key, seconds, args.work_ms / 1000))
            cpu, wakes, rate = results[key][-1]
            print(
                f"[travel] round {r + 1}, {key[0]}, {key[1]} together: {cpu:.3f} CPU ms, {wakes:.1f} wake-ups a batch, {rate:.0f}/s",
                file=sys.stderr,
                flush=True,
            )
    print(f"## bench_travel: {bl.machine_line()}\n")
    print(
        f"f32 batches ({NBYTES / 1e6:.1f} MB in shared memory, not gathered; the worker's {args.work_ms:g} CPU ms a batch of work besides taken off), "
        f"a window of {WINDOW}; medians of {rounds} "
        f"interleaved round(s) of {seconds:g} s. loaderd's own per-batch steps, alone on one thread: {floor:.3f} CPU ms "
        "(bench_limits section 5).\n"
    )
    print("| path | batches a message | CPU ms a batch, all processes | of it travel | wake-ups a batch | batches/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for (path, group), values in results.items():
        cpu = statistics.median(v[0] for v in values)
        wakes = statistics.median(v[1] for v in values)
        rate = statistics.median(v[2] for v in values)
        print(f"| {path} | {group} | {cpu:.3f} | {cpu - floor:.3f} | {wakes:.1f} | {rate:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
