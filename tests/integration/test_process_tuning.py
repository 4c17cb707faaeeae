"""loaderd.process_tuning: no process-wide change at import, each once at first use, and one switch that turns them off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loaderd import process_tuning

# Imports loaderd and RemoteDataLoader, then uses the two tunings as a loader would (a loader's
# constructor calls freeze_imports, its first gRPC stream raise_mmap_threshold).
PROBE = """
import gc
import loaderd
from loaderd import RemoteDataLoader
from loaderd import process_tuning
from loaderd.stream import c_heap
print("after_import", gc.get_freeze_count())
print("froze", process_tuning.freeze_imports(), process_tuning.freeze_imports(), gc.get_freeze_count() > 0)
print("heap", c_heap.raise_mmap_threshold())
"""


def probe(env_value: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != process_tuning.ENV}
    if env_value is not None:
        env[process_tuning.ENV] = env_value
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.timeout(60)
def test_nothing_at_import_then_each_once() -> None:
    assert probe(None) == ["after_import 0", "froze True False True", "heap True"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_the_switch_turns_both_off(value: str) -> None:
    assert probe(value) == ["after_import 0", "froze False False False", "heap False"]


@pytest.mark.timeout(10)
def test_enabled_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(process_tuning.ENV, raising=False)
    assert process_tuning.enabled()
    for on in ("1", "yes", "on", ""):
        monkeypatch.setenv(process_tuning.ENV, on)
        assert process_tuning.enabled(), on
    monkeypatch.setenv(process_tuning.ENV, "OFF")
    assert not process_tuning.enabled()
