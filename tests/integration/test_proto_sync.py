"""The generated protobuf code must match proto/loaderd/v1/loaderd.proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_generated_protobuf_is_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(TESTS_DIR / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=TESTS_DIR.parent,
    )
    assert proc.returncode == 0, f"gen_proto.py --check failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "up to date" in proc.stdout
