"""Faults of the second day (issue 32): folders in use, odd inputs checked at start-up, cosmetic messages."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_claimed_shard_folder_names_the_process_that_holds_it(tmp_path):
    # sample.py, training.latents and train.py share one lock (atomic_files.folder_lock); each refusal names the
    # process, as /proc/locks lists it.
    from atomic_files.shards import ShardFolder

    folder = ShardFolder(tmp_path / "out.shards", ["shard-0.npz"], {"seed": 0})
    folder.claim()
    try:
        second = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from atomic_files.shards import ShardFolder\n"
                "try:\n    ShardFolder(sys.argv[1], ['shard-0.npz'], {'seed': 0}).claim()\n"
                "except Exception as error:\n    print(error)",
                str(tmp_path / "out.shards"),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        folder.release()
    assert f"is being written by another run right now (process {os.getpid()})" in second.stdout, second.stderr
