"""Where a dataset's item store lives: its fingerprint and its file (torch-free: the daemon process
reads it for ``loaderd status``, and the daemon never imports torch)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from loaderd.server.cache.usage import CacheLocation
from loaderd.server.config.schema import CacheSpec, DatasetSpec
from loaderd.wire.limits import SHM_DIR

# The records' format (server/cache/item_codec.py writes it at each record's head): part of the fingerprint,
# so a new format never reads the old records.
RECORD_FORMAT = b"LDI1"


def fingerprint(spec: DatasetSpec, cache: CacheSpec) -> str:
    """The items' identity: what builds the dataset, the user's version and the records' format (hex)."""
    what = {"format": RECORD_FORMAT.decode(), "factory": spec.factory, "args": spec.args, "kwargs": spec.kwargs, "version": cache.version}
    # YAML's values are JSON's, bar a few (dates, non-string keys): repr keeps them apart.
    text = json.dumps(what, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def store_path(spec: DatasetSpec, cache: CacheSpec, memory_prefix: str | None) -> str | None:
    """The environment's file for ``spec``; None for a memory tier without a prefix (no shared memory here)."""
    name = f"items-{fingerprint(spec, cache)}"
    if cache.tier == "memory":
        return os.path.join(SHM_DIR, f"{memory_prefix}{name}") if memory_prefix is not None else None
    assert cache.path is not None  # the config's check: a disk tier names its directory
    return str(Path(cache.path) / f"loaderd-{name}.mdb")


def locate(spec: DatasetSpec, memory_prefix: str | None) -> CacheLocation | None:
    """Where ``spec``'s store is (None: no ``cache:``, or a memory tier without shared memory)."""
    if spec.cache is None:
        return None
    path = store_path(spec, spec.cache, memory_prefix)
    return None if path is None else CacheLocation(spec.cache.tier, spec.cache.max_bytes, path)
