"""Running a script in a fresh interpreter (e.g. one that blocks ``import torch``) for tests."""

from __future__ import annotations

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
