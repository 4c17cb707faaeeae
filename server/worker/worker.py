"""A pool worker process: builds the config's datasets once, then serves tasks.

The entry point is :func:`run_worker`, a top-level function taking one frozen
:class:`WorkerSpec`. A worker never talks to clients: it reads tasks from one
pipe and writes results to another, and exits when it reads ``None``, when
its pipe breaks, or when its parent (the daemon's fork server) goes away.
This module is the process's life and its task loop; its datasets are built by
server/worker/datasets.py and its batches made by ``BatchMaker`` (server/worker/batches.py).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
import types

import torch

from loaderd.errors import clip
from loaderd.server.cache.item_store import open_store
from loaderd.server.process import stack_dumps
from loaderd.server.process.heap import give_back_free_pages, tune_heap
from loaderd.server.process.log_format import configure_logging
from loaderd.server.process.multiprocessing_private import drop_fork_server_handle
from loaderd.server.worker.batches import BatchMaker
from loaderd.server.worker.datasets import build_for_worker
from loaderd.server.worker.entry import WorkerSpec
from loaderd.server.worker.task_inbox import TaskInbox
from loaderd.server.worker.tasks import (
    FetchTask,
    IterTask,
    ReleaseSlot,
    ReleaseStream,
    SettleCache,
    Task,
    WorkerReady,
    WorkerStartFailed,
    send_result,
)
from loaderd.server.worker.user_code import apply_python_path

log = logging.getLogger("loaderd.worker")

# How often a worker idle on its task pipe checks that its parent is still alive.
_PARENT_CHECK_S = 0.5
# A worker idle this long gives its idle shared-memory segments back to the system.
_TRIM_IDLE_S = 10.0
# Added to a worker's oom_score_adj (see ``_prefer_oom_kill``).
OOM_SCORE_ADJ_BOOST = 300


def _handle(batches: BatchMaker, task: Task, worker_id: int) -> None:
    """Run one task. An exception that escapes the task's own handling fails that
    batch (as data, to the client); the worker carries on."""
    try:
        if isinstance(task, FetchTask):
            batches.fetch(task)
        elif isinstance(task, IterTask):
            batches.iterate(task)
        elif isinstance(task, ReleaseStream):
            batches.release_stream(task.stream_id)
        elif isinstance(task, ReleaseSlot):
            batches.release_slot(task.name)
        elif isinstance(task, SettleCache):
            batches.datasets[task.dataset].settle_cache(task.on)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        raise  # the daemon is gone: the worker exits
    except Exception as exc:
        if isinstance(task, (FetchTask, IterTask)):
            batches.fail(task.stream_id, task.seq, exc, f"in pool worker {worker_id} handling batch {task.seq}")
        else:
            log.exception("worker %d: %s failed", worker_id, type(task).__name__)


def new_packages(before: set[str]) -> tuple[str, ...]:
    """Top-level packages in ``sys.modules`` now that were not in ``before``: neither the standard library's, nor
    modules no import made (an extension's runtime module, such as ``cython_runtime``, has no ``__spec__``)."""
    modules = dict(sys.modules)
    tops = {name.partition(".")[0] for name in modules if name not in before}
    found = (top for top in tops if top not in before and top not in sys.stdlib_module_names and not top.startswith("_"))
    # ``sys.modules[name] = None`` blocks an import: only modules an import made count.
    return tuple(sorted(top for top in found if isinstance(modules.get(top), types.ModuleType) and modules[top].__spec__ is not None))


def _prefer_oom_kill() -> None:
    """Make this worker the kernel OOM killer's first pick among the daemon's processes.

    A worker holds about what the fork server holds (the datasets, torch), so by size
    the killer may take either; but a killed worker is replaced and its batch retried,
    while the fork server's death ends every worker (and a ``build: once`` pool for
    good). Raising one's own score needs no privilege; where /proc refuses, nothing changes.
    """
    try:
        with open("/proc/self/oom_score_adj", "r+") as adj:
            current = int(adj.read())
            adj.seek(0)
            adj.write(str(min(1000, current + OOM_SCORE_ADJ_BOOST)))
    except (OSError, ValueError):
        pass


def run_worker(spec: WorkerSpec) -> None:
    """A worker process's life (started through ``loaderd.server.worker.entry.worker_main``)."""
    drop_fork_server_handle()  # see server/process/multiprocessing_private.py
    _prefer_oom_kill()
    # What the fork server imported and built is shared copy-on-write: out of the collector's
    # way, or the first full collection writes to (copies) every page holding those objects.
    gc.freeze()
    # The daemon owns shutdown; a terminal's Ctrl-C must not kill workers mid-batch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stack_dumps.install()  # a worker signalled with its daemon dumps its stacks too, and lives
    # Like torch's DataLoader workers: one intra-op thread each, or N workers oversubscribe the cores.
    torch.set_num_threads(1)
    # The daemon's level and format (a dataset's own log lines included): workers share its stderr.
    configure_logging(spec.config.log_level, spec.config.log_format)
    # Keep freed blocks for reuse (server/process/heap.py), as the daemon does: an item's decode buffers, its
    # transform's tensors and a cache hit's copy are each a fresh mapping otherwise, faulted in and zeroed
    # every item (the cached image pipeline, one thread: ~5% of a miss's CPU, 5-25% of a hit's; HISTORY.md).
    # An idle worker gives the free pages back (below).
    tune_heap()
    apply_python_path(spec.config.python_path)
    parent = os.getppid()
    batches: BatchMaker | None = None
    try:
        try:
            # Every dataset built, and map-style worker_init_fns run, as torch does at worker start.
            preloaded = set(sys.modules)
            datasets = {name: build_for_worker(ds, spec.worker_id, spec.pool_size) for name, ds in spec.config.datasets.items()}
            imported = new_packages(preloaded)
            for ds in datasets.values():
                ds.store = open_store(ds.spec, spec.cache_prefix)  # LMDB: opened here, after the fork, never inherited
            ready = WorkerReady(worker_id=spec.worker_id, datasets={n: d.meta() for n, d in datasets.items()}, imported=imported)
        except Exception as exc:  # noqa: BLE001 - a dataset's constructor may raise anything: the pool reports it
            send_result(spec.results, WorkerStartFailed(worker_id=spec.worker_id, message=clip(str(exc), 4000)))
            return
        inbox = TaskInbox(spec.tasks)
        batches = BatchMaker(spec, datasets, freed=inbox.freed, ahead=inbox.peek)
        send_result(spec.results, ready)
        busy_at = time.monotonic()
        heap_trimmed = False
        while True:
            if batches.results.held and not inbox.wait(0):
                batches.results.flush()  # never wait for work with results held (server/worker/result_group.py)
            if not inbox.wait(_PARENT_CHECK_S):
                if os.getppid() != parent:  # the daemon (and its fork server) went away
                    return
                if time.monotonic() - busy_at > _TRIM_IDLE_S:
                    batches.trim()
                    if not heap_trimmed:
                        give_back_free_pages()
                        heap_trimmed = True
                continue
            task = inbox.take()  # EOFError once the daemon closed our task pipe (handled below: the worker ends)
            if task is None:
                batches.results.flush()
                return
            _handle(batches, task, spec.worker_id)
            busy_at = time.monotonic()
            heap_trimmed = False
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return  # the daemon closed our pipe: it is shutting down or gone
    finally:
        if batches is not None:
            # Our segments may hold batches the daemon handed to clients: while the
            # daemon lives, its slot ledger unlinks them once nobody holds one
            # (however this worker ended). Only an orphan cleans up after itself.
            batches.close(unlink=os.getppid() != parent)
