"""Shared by the study tests: run a bench study's --quick mode in a subprocess, as a user would."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_quick(module: str, out: Path) -> str:
    """`python -m <module> --quick --out <out>` single-threaded and offline; its stdout (fails on an error)."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", module, "--quick", "--out", str(out)],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
