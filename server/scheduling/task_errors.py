"""The errors the daemon reports for a batch its workers could not finish, as the client receives them.

Each is a loaderd exception captured as a serialized ``RemoteError`` (loaderd.errors), so it
reaches the training loop with its type, like a user's exception from ``__getitem__``.
"""

from __future__ import annotations

from loaderd.errors import BatchTimeoutError, WorkerCrashedError, capture_exception, clip
from loaderd.server.worker.tasks import BatchTask, IterTask


def timeout_error(task: BatchTask, limit: float, worker_id: int, ran: float) -> bytes:
    """``task`` ran ``ran`` seconds in ``worker_id``, past its dataset's ``task_timeout`` of ``limit``."""
    if isinstance(task, IterTask):
        what = f"batch {task.batch_index} of replica {task.replica}"
    else:
        indices = list(task.indices) if isinstance(task.indices, tuple) else task.indices
        what = f"batch {task.seq if task.position < 0 else task.position} (indices {clip(str(indices), 200)})"
    exc = BatchTimeoutError(
        f"{what} of dataset {task.dataset!r} ran {ran:.1f}s, past its task_timeout of {limit:g}s; "
        "its pool worker was killed and replaced, and the loader goes on with the next batch"
    )
    return capture_exception(exc, f"in pool worker {worker_id}", task.seq).SerializeToString()


def crash_error(task: BatchTask, attempts: int, worker_id: int, exitcode: int | None) -> bytes:
    """Pool workers died ``attempts`` times running ``task``, the last one ``worker_id`` with ``exitcode``."""
    what = f"replica {task.replica} batch {task.batch_index}" if isinstance(task, IterTask) else f"batch {task.seq}"
    exc = WorkerCrashedError(
        f"pool workers died {attempts} times running {what} of dataset {task.dataset!r} (last exit code {exitcode}); skipping it"
    )
    return capture_exception(exc, f"in pool worker {worker_id}", task.seq).SerializeToString()
