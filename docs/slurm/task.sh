#!/bin/bash
# One srun task as one process of a torch.distributed job: torch's variables from Slurm's (and docs/slurm/job.sh's
# MAIN_HOST and MAIN_PORT), then the command. One task per GPU: each process takes the GPU of its local rank.
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
export LOCAL_WORLD_SIZE=$((SLURM_NTASKS / SLURM_NNODES)) GROUP_RANK=$SLURM_NODEID
export MASTER_ADDR=${MAIN_HOST:?set by docs/slurm/job.sh} MASTER_PORT=${MAIN_PORT:?set by docs/slurm/job.sh}
if [ -n "${SLURM_GPUS_ON_NODE:-}" ] && [ "$SLURM_GPUS_ON_NODE" -ne "$LOCAL_WORLD_SIZE" ]; then
    [ "$RANK" -eq 0 ] && echo "error: $LOCAL_WORLD_SIZE tasks per node but $SLURM_GPUS_ON_NODE GPUs per node: ask" \
        "for one task per GPU (--ntasks-per-node=N --gpus-per-node=N)" >&2
    exit 2
fi
exec "$@"
