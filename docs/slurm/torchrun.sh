#!/bin/bash
# One srun task per node as that node's torchrun: PROCESSES_PER_NODE processes (default: one per GPU of the node),
# meeting the other nodes' at docs/slurm/job.sh's MAIN_HOST:MAIN_PORT, then the command (a script and its arguments).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}  # torchrun waits this long for the stop
exec torchrun --nnodes "$SLURM_NNODES" --node_rank "$SLURM_NODEID" \
    --nproc_per_node "${PROCESSES_PER_NODE:-${SLURM_GPUS_ON_NODE:?no GPU on this node: set PROCESSES_PER_NODE}}" \
    --master_addr "$MAIN_HOST" --master_port "$MAIN_PORT" "$@"
