"""BatchMaker: one worker's batches, from a task to the results pipe.

A map-style batch is fetched by its indices (``__getitems__`` where the dataset has
it); an iterable one is drawn from the stream's replica of the dataset (made at its
first batch, and replayed up to the batch asked for when a replacement worker takes
over). Either is collated, straight into one of the worker's shared-memory slots where
torch's default collation does it, encoded for the wire and sent: a ``BatchDone``
naming its slot, or followed by its raw buffers on the pipe. Seeds and
``get_worker_info()`` are set around the user's code as torch's workers set them.
Whatever the user's code raises goes back to the client as data (``BatchFailed``);
the worker lives on. Used by the worker's task loop (server/worker/worker.py) only.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch.utils.data._utils.worker as torch_worker
from torch.utils.data._utils.collate import default_collate

from loaderd.errors import TransportError, capture_exception, clip
from loaderd.server.cache.usage import CacheDelta
from loaderd.server.process.heap import give_back_free_pages
from loaderd.server.worker.datasets import WorkerDataset, pool_info, set_worker_info
from loaderd.server.worker.entry import WorkerSpec
from loaderd.server.worker.result_group import HOLD_BELOW_S, ResultGroup
from loaderd.server.worker.run_ahead import RunAhead
from loaderd.server.worker.seeding import derive_seed, seed_everything
from loaderd.server.worker.slot_collate import SlotArea, SlotFull, collate_into, collate_private, estimate_bytes
from loaderd.server.worker.slot_writer import SlotWriter
from loaderd.server.worker.tasks import (
    BatchDone,
    BatchFailed,
    FetchTask,
    IterTask,
    ReplicaExhausted,
    SlotsRetired,
    Task,
)
from loaderd.wire.batch_encoder import encode_batch
from loaderd.wire.limits import MAX_HEADER_BYTES

log = logging.getLogger("loaderd.worker")

# What a replica's ``next()`` returns past its end (a sample may be None itself).
_END = object()


@dataclass
class _Replica:
    """One replica of an iterable dataset for one stream (torch: one worker's copy)."""

    iterator: Iterator[Any]
    info: torch_worker.WorkerInfo | None
    next_batch: int = 0



def _indices_of(task: FetchTask) -> str:
    """A map-style batch's indices as its failure names them (bounded), as a timed-out batch's are."""
    if not task.auto_collation:
        return f"index {task.indices}"
    return f"indices {clip(str(list(cast(tuple[int, ...], task.indices))), 200)}"

class BatchMaker:
    """One worker's batches: its datasets, the iterable replicas it holds, its shared-memory slots."""

    def __init__(
        self,
        spec: WorkerSpec,
        datasets: dict[str, WorkerDataset],
        freed: Callable[[], list[str]] | None = None,
        ahead: Callable[[], Task | None] | None = None,
    ) -> None:
        """``freed``: the slots the daemon gave back that wait in the task pipe (``TaskInbox.freed``); ``ahead``: the
        task the worker takes next, if it is in the pipe now (``TaskInbox.peek``)."""
        self.spec = spec
        self.datasets = datasets
        self.replicas: dict[tuple[int, int], _Replica] = {}
        self.results = ResultGroup(spec.results)  # finished batches go several in one write (server/worker/result_group.py)
        self._ahead = ahead
        # The next task's items, started while a batch of item threads is finished (server/worker/run_ahead.py).
        self._run_ahead = RunAhead(ahead, datasets, self._pool_info, spec.worker_id) if ahead is not None else None
        self.slots = SlotWriter(spec.shm_prefix, spec.shm_cap_bytes, freed=freed) if spec.shm_prefix else None

    def _pool_info(self, ds: WorkerDataset, seed: int) -> torch_worker.WorkerInfo:
        return pool_info(ds, self.spec.worker_id, self.spec.pool_size, seed)

    def _ahead_info(self) -> torch_worker.WorkerInfo | None:
        """What ``get_worker_info()`` says outside a batch's own code: the batch started ahead's, else None."""
        return None if self._run_ahead is None else self._run_ahead.info

    # ------------------------------------------------------------ results

    def _collate(self, ds: WorkerDataset, samples: list[Any], inline: bool) -> tuple[Any, tuple[str, SlotArea] | None]:
        """Collate a batch; with torch's default collation (and not ``inline``), straight into a shared-memory slot."""
        if ds.collate is not default_collate:
            return ds.collate(samples), None
        if self.slots is None or inline or not samples:
            return collate_private(samples), None
        acquired = self.slots.acquire(estimate_bytes(samples[0], len(samples)))
        if acquired is None:
            return collate_private(samples), None
        name, base = acquired
        area = SlotArea(base)
        try:
            return collate_into(samples, area), (name, area)
        except SlotFull:  # items of different sizes: collate normally, copy afterwards
            self.slots.release(name)
            return collate_private(samples), None
        except BaseException:
            self.slots.release(name)
            raise

    def _encode(
        self,
        stream_id: int,
        seq: int,
        batch: Any,
        placed: tuple[str, SlotArea] | None,
        inline: bool,
        cache: CacheDelta | None = None,
        made_s: float | None = None,
    ) -> tuple[BatchDone, list[memoryview]]:
        """The batch's ``BatchDone`` and the raw buffers to send after it (none if it went to a slot).

        TransportError if it cannot be put on the wire; ``placed``'s slot is then free again.
        """
        slot = None
        try:
            if placed is not None and self.slots is not None:
                name, area = placed
                encoded = encode_batch(batch, area.base, area.used)
                slot = self.slots.commit(name, encoded)
                if slot is None:  # the rest did not fit after the collated part
                    encoded = encode_batch(batch)
            else:
                encoded = encode_batch(batch)
            value = encoded.value.SerializeToString()
        except Exception as exc:
            if placed is not None and self.slots is not None:
                self.slots.release(placed[0])
            if isinstance(exc, TransportError):
                raise
            # Whatever the batch holds that the codec chokes on (a value out of range, a
            # structure too deep): this batch fails, the worker lives.
            raise TransportError(f"cannot encode the batch: {type(exc).__name__}: {clip(str(exc), 500)}") from exc
        if len(value) > MAX_HEADER_BYTES:
            if slot is not None and self.slots is not None:
                self.slots.release(slot.name)
            raise TransportError(
                f"the batch's structure (everything but its arrays) takes {len(value)} bytes on the wire; "
                f"at most {MAX_HEADER_BYTES} fit in one message (return tensors or arrays instead of many Python objects)"
            )
        if slot is None and self.slots is not None and not inline:
            slot = self.slots.write(encoded)
        done = BatchDone(
            stream_id=stream_id,
            seq=seq,
            value=value,
            payload_bytes=encoded.payload_bytes,
            slot=slot,
            buffer_offsets=() if slot else tuple(offset for offset, _ in encoded.buffers),
            retired=self._take_retired(),
            cache=cache,
            made_s=made_s,
        )
        return done, [] if slot else [buf for _, buf in encoded.buffers]

    def _take_retired(self) -> tuple[str, ...]:
        if self.slots is None or not self.slots.retired:
            return ()
        retired = tuple(self.slots.retired)
        self.slots.retired.clear()
        return retired

    def fail(self, stream_id: int, seq: int, exc: BaseException, where: str) -> None:
        """Fail batch ``seq`` of stream ``stream_id``: ``exc`` goes back to its client as data."""
        err = capture_exception(exc, where, seq)
        self.results.send(BatchFailed(stream_id=stream_id, seq=seq, error=err.SerializeToString()))

    # ------------------------------------------------------------ map-style

    def fetch(self, task: FetchTask) -> None:
        """Make and send a map-style batch (or its failure)."""
        ds = self.datasets[task.dataset]
        started = time.perf_counter()  # held only if quick (server/worker/result_group.py); threads: auto measures it
        position = task.seq if task.position < 0 else task.position
        where = f"in pool worker {self.spec.worker_id} while fetching batch {position} of dataset {task.dataset!r}"
        job = None if self._run_ahead is None else self._run_ahead.take(task)  # seeded when its items started
        if job is None:
            seed_everything(task.seed)
            set_worker_info(self._pool_info(ds, task.seed))
        try:
            if task.auto_collation:
                indices = list(cast(tuple[int, ...], task.indices))  # a batch's, with auto-collation
                if job is None:
                    job = ds.start_items(indices)  # on the item threads (None: made by ds.items below)
                if job is None:
                    # From the item cache where the dataset has one, then each through its transform (server/worker/datasets.py).
                    samples = ds.items(indices)
                else:
                    job.wait_taken()
                    if job.helped and self._run_ahead is not None:
                        self._run_ahead.start_next()  # as the threads turn free (server/worker/run_ahead.py)
                    samples = job.result()
                # Collate without worker info: torch's default_collate would otherwise put every batch in a fresh
                # shared-memory segment. Where the next batch's items run they keep theirs, and _collate stacks
                # without looking at it.
                set_worker_info(self._ahead_info())
                batch, placed = self._collate(ds, samples, task.inline)
            else:
                sample = ds.item(task.indices)
                set_worker_info(self._ahead_info())
                batch, placed = ds.convert(sample), None
        except Exception as exc:  # noqa: BLE001 - the user's code may raise anything: it goes back to the client as data
            self.fail(task.stream_id, task.seq, exc, f"{where} ({_indices_of(task)})")  # worded only on failure
            return
        finally:
            set_worker_info(self._ahead_info())
        made_s = time.perf_counter() - started
        self._send_encoded(task.stream_id, task.seq, batch, where, placed, task.inline, task.dataset, self._may_hold(task, made_s), made_s)
        if task.auto_collation and ds.sizer is not None:
            try:
                self._sized(ds, len(cast(tuple[int, ...], task.indices)), time.perf_counter() - started)
            except Exception:  # the batch went out already: a failure here must not answer it a second time
                log.exception("worker %d: sizing dataset %r's item threads failed", self.spec.worker_id, ds.spec.name)

    def _sized(self, ds: WorkerDataset, items: int, seconds: float) -> None:
        """Tell a ``threads: auto`` dataset's sizer what a batch took (server/worker/thread_sizer.py); log a change."""
        before = ds.threads.count
        count = ds.made(items, seconds)
        if count is not None:
            assert ds.sizer is not None
            if count < before:
                # What the larger count had in flight would stay a while: the heap keeps freed blocks
                # (server/process/heap.py), and a segment the smaller count no longer needs goes only once idle for
                # IDLE_SEGMENT_S (server/worker/slot_writer.py). A try of 32 threads left ~60 MiB of heap and a third
                # 38.5 MB segment (bench_images, reads of 20 ms). The free segments but the one freed last go now: the
                # batch after next reuses one given back by then, or makes one.
                give_back_free_pages()
                self.trim(keep=1)
            log.info(
                "worker %d: dataset %r now runs %d item threads (threads: auto; %d made %.0f items/s)",
                self.spec.worker_id,
                ds.spec.name,
                count,
                before,
                ds.sizer.last_rate,
            )

    def _may_hold(self, task: FetchTask, seconds: float) -> bool:
        """Whether ``task``'s result, made in ``seconds``, may wait for the next ones (server/worker/result_group.py)."""
        if not task.grouped or seconds >= HOLD_BELOW_S or self._ahead is None:
            return False
        following = self._ahead()
        # Of the same dataset: as quick as this one, as far as anyone knows (another's could take any time).
        return isinstance(following, FetchTask) and following.grouped and following.dataset == task.dataset

    def _send_encoded(
        self,
        stream_id: int,
        seq: int,
        batch: Any,
        where: str,
        placed: tuple[str, SlotArea] | None,
        inline: bool,
        dataset: str = "",
        hold: bool = False,
        made_s: float | None = None,
    ) -> None:
        ds = self.datasets.get(dataset)
        # The cache's counts since its last batch go with this one (the daemon sums them per dataset).
        cache = ds.store.stats.take() if ds is not None and ds.store is not None else None
        try:
            done, buffers = self._encode(stream_id, seq, batch, placed, inline, cache, made_s)
        except TransportError as exc:
            self.fail(stream_id, seq, exc, where)
            return
        self.results.send(done, hold=hold, payload=buffers)  # one with a payload is never held (result_group.py)

    # ------------------------------------------------------------ iterable

    def _new_replica(self, task: IterTask, ds: WorkerDataset) -> _Replica:
        try:
            dataset = copy.deepcopy(ds.dataset)
        except Exception:  # noqa: BLE001 - unpicklable state (open files, locks): build a fresh one
            dataset = ds.factory(*ds.spec.args, **ds.spec.kwargs)
        info = None
        if task.num_replicas > 0:
            info = torch_worker.WorkerInfo(
                id=task.replica, num_workers=task.num_replicas, seed=task.base_seed + task.replica, dataset=dataset
            )
        set_worker_info(info)
        try:
            if info is not None and ds.worker_init_fn is not None:
                seed_everything(derive_seed(task.base_seed, task.replica))
                ds.worker_init_fn(task.replica)
            iterator = iter(dataset)
        finally:
            set_worker_info(None)
        return _Replica(iterator=iterator, info=info)

    def _next_batch(self, task: IterTask, ds: WorkerDataset, replica: _Replica) -> Any | None:
        """Pull one batch's samples from the replica; None when it is exhausted."""
        seed_everything(derive_seed(task.base_seed, task.replica, replica.next_batch))
        set_worker_info(replica.info)
        try:
            transform = ds.transform  # per sample as the iterator yields it, under this batch's seed
            if task.batch_size:
                samples = list(itertools.islice(replica.iterator, task.batch_size))
                if not samples or (task.drop_last and len(samples) < task.batch_size):
                    return None
                return ds.transformed(samples)  # across the item threads (the iterator itself runs on this one)
            sample = next(replica.iterator, _END)
            if sample is _END:
                return None
            return sample if transform is None else transform(sample)
        finally:
            replica.next_batch += 1
            set_worker_info(None)

    def iterate(self, task: IterTask) -> None:
        """Make and send the batch of an iterable replica that ``task`` asks for (its failure, or ``ReplicaExhausted``)."""
        ds = self.datasets[task.dataset]
        where = (
            f"in pool worker {self.spec.worker_id} while producing batch {task.batch_index} "
            f"of replica {task.replica} of dataset {task.dataset!r}"
        )
        key = (task.stream_id, task.replica)
        try:
            replica = self.replicas.get(key)
            if replica is None or replica.next_batch > task.batch_index:
                replica = self.replicas[key] = self._new_replica(task, ds)
            # A replacement worker replays what its predecessor already
            # delivered, under the same per-batch seeds, then carries on.
            while replica.next_batch < task.batch_index:
                if self._next_batch(task, ds, replica) is None:
                    break
            samples = self._next_batch(task, ds, replica)
        except Exception as exc:  # noqa: BLE001 - the user's code may raise anything: it goes back to the client as data
            self.fail(task.stream_id, task.seq, exc, where)
            return
        if samples is None:
            self.results.send(ReplicaExhausted(stream_id=task.stream_id, seq=task.seq))
            return
        try:
            batch, placed = self._collate(ds, samples, task.inline) if task.batch_size else (ds.convert(samples), None)
        except Exception as exc:  # noqa: BLE001 - the user's collate may raise anything: it goes back to the client as data
            self.fail(task.stream_id, task.seq, exc, where)
            return
        self._send_encoded(task.stream_id, task.seq, batch, where, placed, task.inline)

    def trim(self, keep: int = 0) -> None:
        """Remove free segments (all but the ``keep`` freed last) and tell the daemon, which unmaps them (and tells its
        clients)."""
        if self.slots is None:
            return
        self.slots.trim(keep)
        retired = self._take_retired()
        if retired:
            self.results.send(SlotsRetired(retired))

    def release_stream(self, stream_id: int) -> None:
        """Forget a finished stream's iterable replicas."""
        for key in [k for k in self.replicas if k[0] == stream_id]:
            del self.replicas[key]

    def release_slot(self, name: str) -> None:
        """The daemon is done with segment ``name``: it may take another batch."""
        if self.slots is not None:
            self.slots.release(name)

    def close(self, unlink: bool) -> None:
        """Join the datasets' item threads; drop the slots' mappings; with ``unlink``, remove their segments too."""
        if self._run_ahead is not None:
            self._run_ahead.clear()
        for ds in self.datasets.values():
            stuck = ds.threads.close()
            if stuck:
                log.warning("worker %d: item threads %s still inside an item at the worker's end", self.spec.worker_id, ", ".join(stuck))
        if self.slots is not None:
            self.slots.close(unlink=unlink)
