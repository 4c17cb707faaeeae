"""Run one of tests/support's training scripts as torchrun runs a job: a process per rank, gloo on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.daemons import TESTS_DIR

RUN_TIMEOUT_S = 150


def script_env(**extra: str) -> dict[str, str]:
    """This process's environment with tests/ first on PYTHONPATH (an inherited PYTHONPATH is kept) and one
    thread per process (2 cores, 2 ranks and a daemon)."""
    path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def torchrun(module: str, spec: dict[str, Any], tmp: Path, processes: int = 2, **env: str) -> list[dict[str, Any]]:
    """``python -m torch.distributed.run --nproc-per-node N --standalone -m MODULE SPEC_JSON``; each rank's
    record, which the script writes to ``{spec["out"]}.rank{r}.json``. Run as modules: run as files,
    tests/support would come first on sys.path and its datasets.py would hide HuggingFace's ``datasets``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--standalone",
               "-m", module, json.dumps(spec)]
    done = subprocess.run(command, env=script_env(**env), capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=tmp)
    assert done.returncode == 0, f"{module} {spec.get('out')} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    return [json.loads(Path(f"{spec['out']}.rank{rank}.json").read_text()) for rank in range(processes)]
