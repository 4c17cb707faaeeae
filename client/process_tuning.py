"""What loaderd changes in a training process beyond its own objects, and the switch that turns it off.

A library should not retune the process it is imported into silently. loaderd does two things,
each once per process and neither at ``import loaderd``; ``LOADERD_PROCESS_TUNING=0`` in the
environment turns both off (the loader then works the same, a little slower where noted):

- ``freeze_imports()``, at the first ``RemoteDataLoader``: ``gc.freeze()`` moves everything
  imported by then (torch, numpy, grpc, loaderd) to the collector's permanent generation.
  Otherwise the first full collection rescans torch's whole import heap (~90 ms on the
  development machine) at a moment chosen by allocation counts, typically inside a fresh
  process's first batch (tests/bench/bench_loaders.py "fresh client process"). Objects made
  later are collected as usual; those frozen are never freed, as they live until exit anyway.
- ``loaderd.stream.c_heap.raise_mmap_threshold()``, at the first gRPC stream: one 16 MiB
  allocation freed, the nudge glibc gives itself when any large block is freed, so received
  messages reuse heap pages instead of faulting in fresh mappings (see that module).
"""

from __future__ import annotations

import gc
import os
import threading

ENV = "LOADERD_PROCESS_TUNING"

_lock = threading.Lock()
_frozen = False


def enabled() -> bool:
    """False where ``LOADERD_PROCESS_TUNING`` is 0, false, no or off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def freeze_imports() -> bool:
    """``gc.freeze()``, once per process and only where tuning is enabled. Returns whether this call did it."""
    global _frozen
    with _lock:
        if _frozen or not enabled():
            return False
        _frozen = True
    gc.freeze()
    return True
