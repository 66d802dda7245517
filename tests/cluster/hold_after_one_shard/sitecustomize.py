"""Holds a job's first start after one shard per process, so that a test can requeue it mid-way on any machine.

Python runs `sitecustomize` at the start of every process that has this folder on its PYTHONPATH; tests/test_slurm.py
puts it there (with the repository) for one sampling job. On that job's first start each process of sample.py writes
one shard and then sleeps until the scheduler ends it: a job of two tasks stands still with exactly two of its shards
written, however fast the machine samples. A restarted job (Slurm sets SLURM_RESTART_COUNT to the number of
restarts) writes its shards as usual.
"""

import os
import time

if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    from atomic_files.shards import ShardFolder

    write_shard = ShardFolder.write

    def write_one_shard_then_hold(self, index, write) -> None:
        write_shard(self, index, write)
        while True:  # until `scontrol requeue` (SIGTERM) or `scancel` ends the process
            time.sleep(1)

    ShardFolder.write = write_one_shard_then_hold
