"""Running a script in a fresh interpreter (e.g. one that blocks ``import torch``), or as the
ranks of a ``torchrun`` job, for tests."""

from __future__ import annotations

import os
import subprocess
import sys


def run_script(script: str, *args: object, timeout: float = 120) -> str:
    """Run ``python -c script args…``; fail the test with its stderr unless it exits 0."""
    result = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def torchrun(*args: object, nproc: int = 2, timeout: float = 300, env: dict | None = None):
    """``torchrun --standalone --nproc-per-node N args…``; fails the test unless it exits 0."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), *map(str, args)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)
    assert done.returncode == 0, done.stderr[-4000:]
    return done
