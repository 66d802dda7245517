"""Shared by the tests of bench/ and studies/: run a benchmark's or a study's --quick mode in a subprocess, as a
user would."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_quick(module: str, out: Path, *arguments: str, timeout: int = 900) -> str:
    """`python -m <module> --quick --out <out> <arguments>` single-threaded, offline and on the CPU (a GPU, where
    there is one, hidden: the quick modes are CPU runs); its stdout (fails on an error)."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", module, "--quick", "--out", str(out), *arguments],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
