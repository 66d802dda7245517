#!/bin/bash
# One srun task per node as that node's torchrun: PROCESSES_PER_NODE processes (default: one per GPU of the node),
# meeting the other nodes' at docs/slurm/job.sh's MAIN_HOST:MAIN_PORT, then the command (a script and its arguments).
# torchrun does not pass its workers' status on: when a stop signal ends train.py with a checkpoint (status 75),
# torchrun ends with 1. train.py writes its 75 into STOPPED_STATUS_FILE, a file of this node, and this task ends with
# it, so that docs/slurm/job.sh requeues the job. SIGUSR1 (Slurm's --signal=USR1@N sends it to every process of the
# step) would end torchrun itself, which handles only TERM, INT, HUP and QUIT: it is ignored here and in torchrun
# (train.py sets its own handler). A SIGTERM to this script waits for torchrun, which passes it to its workers.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}  # torchrun waits this long for the stop
status_folder=$(mktemp -d)
export STOPPED_STATUS_FILE=$status_folder/status
trap '' USR1
trap ':' TERM
# A node whose torchrun starts without the others' (a node restarted alone) waits for them RENDEZVOUS_TIMEOUT s,
# silently (torch's default: 600), then ends with 1.
torchrun --nnodes "$SLURM_NNODES" --node_rank "$SLURM_NODEID" --rdzv-conf "timeout=${RENDEZVOUS_TIMEOUT:-600}" \
    --nproc_per_node "${PROCESSES_PER_NODE:-${SLURM_GPUS_ON_NODE:?no GPU on this node: set PROCESSES_PER_NODE}}" \
    --master_addr "$MAIN_HOST" --master_port "$MAIN_PORT" "$@"
status=$?
if [ -s "$STOPPED_STATUS_FILE" ]; then
    status=$(<"$STOPPED_STATUS_FILE")
fi
rm -rf "$status_folder"
exit "$status"
