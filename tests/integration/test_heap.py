"""server/process/heap.py: a daemon streaming multi-MiB batches over gRPC reuses its heap instead of faulting pages in.

Before the daemon tuned glibc's malloc, the 4 MiB messages it joined for gRPC (and
gRPC's copies of them) came from freshly mapped memory: ~2,000 minor page faults
per 12.6 MB batch, a quarter of its CPU per batch. The count is read from the real
daemon's /proc entry.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from support import datasets
from support.daemons import RunningDaemon, glibc_malloc, oracle_loader

from loaderd import RemoteDataLoader

BATCH = 96  # Blocks: 128 KiB items, so 12 MiB of payload a batch (three 4 MiB messages)
PAGE = 4096


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt


@glibc_malloc
@pytest.mark.timeout(120)
def test_daemon_streams_large_batches_over_grpc_without_faulting_in_each_message(
    start_daemon: Callable[..., RunningDaemon],
) -> None:
    daemon = start_daemon({"blocks": {"dataset": "support.datasets:Blocks", "kwargs": {"n": 1920}}})
    loader = RemoteDataLoader("blocks", batch_size=BATCH, address=daemon.address, transport="grpc")
    # The warm-up epoch, checked against torch batch by batch (not held: 12 MiB each).
    seen = 0
    for got, want in zip(loader, oracle_loader(datasets.Blocks(1920), batch_size=BATCH), strict=True):
        assert torch.equal(got, want), f"batch {seen} differs from torch's"
        seen += 1
    assert seen == 20
    before = _minor_faults(daemon.process.pid)
    payload = 0
    for _ in range(3):
        payload += sum(batch.numel() * batch.element_size() for batch in loader)
    faults = _minor_faults(daemon.process.pid) - before
    payload_pages = payload // PAGE
    # glibc's defaults: ~46% of the payload's pages faulted in again (85k of 184k); tuned: ~2.5%.
    assert faults < payload_pages // 10, f"{faults} minor faults in the daemon for {payload_pages} payload pages"


@glibc_malloc
@pytest.mark.timeout(60)
def test_tune_heap_is_taken_by_glibc_and_trimming_does_not_raise() -> None:
    # In a child: the settings are the whole process's, and pytest's own memory checks must not inherit them.
    code = "from loaderd.server.process import heap; assert heap.tune_heap() is True; heap.give_back_free_pages(); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout.strip()) == (0, "ok"), out.stderr


@glibc_malloc
@pytest.mark.timeout(60)
def test_tune_heap_leaves_what_the_operator_set_in_the_environment() -> None:
    code = (
        "import logging, sys; logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='%(message)s'); "
        "from loaderd.server.process import heap; print(heap.tune_heap())"
    )
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": str(1 << 20), "GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "malloc arena_max: left as the environment sets it",
        "malloc trim_threshold: left as the environment sets it",
        "True",
    ], out.stdout
