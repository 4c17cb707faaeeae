"""ResultGroup: a worker's results to the daemon, several finished batches in one write.

A batch whose payload went to shared memory is a few hundred bytes of pickle on the results
pipe, and each such message costs more than its bytes: the worker's write, a wake-up of the
daemon's scheduler and a round of it, a wake-up of the stream's servicer and a message down to
the client. So a worker whose next task is already in its pipe holds a finished batch's result
back and writes up to ``GROUP_SIZE`` in one write; the daemon reads every whole result a pipe
holds in one round (server/pool/pool.py), and the servicer sends the batches ready together in one
message (server/rpc/batch_groups.py). Measured on a 2-core host (bench_ab, f32 and u8 over shared
memory): the trainer's and the daemon's CPU a batch -22 to -24%, the wake-ups of all processes -29 to
-39%, batches/s 0.95-1.04x (docs/pages/performance.md; tests/bench/HISTORY.md, eighteenth session).

The rules (``BatchMaker`` applies the first two, server/worker/batches.py):

- A result is held only if its task is ``grouped`` (the dispatcher says so once the dataset's tasks
  are quick, server/scheduling/dispatcher.py), its batch took less than ``HOLD_BELOW_S`` to make, and
  the task the worker takes next is a ``grouped`` ``FetchTask`` of the same dataset already whole
  in its pipe: a worker never waits for work with a result held, and a held result is late by the
  batches after it in its group, of a dataset whose batches are quick (one that hangs delays the
  results held before it too). A slow batch's messages cost little beside it, and holding it would
  only make its stream wait: an image pipeline's batches (tenths of a second each) go one by one,
  as before, in the windows they had.
- A result whose payload is on the pipe (its arrays' raw bytes, one frame each after it) is never
  held: it goes at once, after what was held, in the same write if it is a small batch's (at most
  ``INLINE_BYTES`` in all), right after it otherwise (shared memory full), not copied into the
  group. Held, a small batch of ~16 ms (its arrays go inline) waited up to three more, and its
  client, spread over two daemons, took it for late and asked the other one too: 160 batches
  computed for 150 (tests/faults/test_failover.py, the daemon added mid-epoch).
- Whatever else the worker sends (a failure, a replica's end, retired segments) goes after the
  results held, in the same write: order is kept.
- A worker that dies holding results loses them: the daemon, which cannot tell which of its tasks
  killed it, blames none and runs each again ungrouped (``Dispatcher.worker_lost``).

Frames are ``multiprocessing.connection``'s (a 4-byte big-endian length, then the pickle), as
``send_result`` writes them (server/worker/tasks.py); the daemon reads them with ``ResultPipe``
(server/pool/result_pipe.py). Results are loaderd's own dataclasses, pickled plainly.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from multiprocessing.connection import Connection

from loaderd.server.shm.arena import INLINE_BYTES
from loaderd.server.worker.tasks import TASK_FRAME, Result

# Results in one write at most: 4 carries most of the saving (2 gave about half of it; HISTORY.md).
GROUP_SIZE = 4
# Only a batch made in less than this is held: its messages cost ~0.3-0.5 ms of CPU in the trainer and the
# daemon, a few percent of it; and a held batch waits at most GROUP_SIZE - 1 more such batches.
HOLD_BELOW_S = 0.02


class ResultGroup:
    """One worker's end of its results pipe (``conn``), holding up to ``size - 1`` results for the next write."""

    def __init__(self, conn: Connection, size: int = GROUP_SIZE) -> None:
        self._conn = conn
        self._size = size
        self._held = bytearray()  # framed results not written yet, in order
        self._count = 0

    @property
    def held(self) -> int:
        """Results held, not written yet."""
        return self._count

    def send(self, result: Result, hold: bool = False, payload: Sequence[memoryview] = ()) -> None:
        """Write ``result``, then its ``payload`` (raw buffers, a frame each), after the ones held; with ``hold``,
        hold it too unless the group is full or it has a payload (the module's rules: that goes at once, in the same
        write up to ``INLINE_BYTES``, after it otherwise, never copied into the group)."""
        data = pickle.dumps(result, pickle.HIGHEST_PROTOCOL)
        self._held += TASK_FRAME.pack(len(data))
        self._held += data
        self._count += 1
        large = sum(buf.nbytes for buf in payload) > INLINE_BYTES
        if not large:
            for buf in payload:
                self._held += TASK_FRAME.pack(buf.nbytes)
                self._held += buf
        if payload or not hold or self._count >= self._size:
            self.flush()
        if large:
            for buf in payload:
                self._conn.send_bytes(buf)

    def flush(self) -> None:
        """Write the results held, in one write where the pipe takes it (BrokenPipeError once the daemon is gone)."""
        if not self._count:
            return
        view = memoryview(self._held)
        try:
            while view:
                view = view[os.write(self._conn.fileno(), view) :]
        finally:
            view.release()
            self._held.clear()
            self._count = 0
