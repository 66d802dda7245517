#!/bin/bash
# One srun task as one process of a torch.distributed job: torch's variables from Slurm's, then the command.
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
export LOCAL_WORLD_SIZE=$((SLURM_NTASKS / SLURM_NNODES)) GROUP_RANK=$SLURM_NODEID
export MASTER_ADDR=${MAIN_HOST:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
export MASTER_PORT=${MAIN_PORT:-29500}
exec "$@"
