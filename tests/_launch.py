"""How the tests start two CPU processes: torchrun as a module of this interpreter (no PATH lookup), on one host.

Accelerate reads torchrun's environment (RANK, WORLD_SIZE, ...), so the scripts it starts see two processes
exactly as under `torchrun --nproc_per_node 2` on a cluster node; `accelerate launch` would need a config file.
"""

import sys

# The launcher's argv up to the script: a free port on this host (--standalone), two workers.
TORCHRUN_TWO_PROCESSES = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
