# Sourced by the batch scripts in this folder (from the folder sbatch ran in, the repository's root): what every job
# shares. JOB names the job to scancel and scontrol. An array task has a job id of its own, but the array's last
# task keeps the array's id, which scancel and scontrol apply to every task of the array: ARRAYID_TASKID names one.
JOB=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}
JOB=${JOB:-$SLURM_JOB_ID}
# The processes of the job meet at MAIN_HOST:MAIN_PORT (torch's MASTER_ADDR and MASTER_PORT): the first node, where
# this script runs, and 15000 + the job id's last four digits (Lightning's rule): unprivileged, below the ports
# Linux hands out to connections (32768 and up), and one of its own for every job and array task on a node. Where
# that port is in use on this node (another job whose id ends in the same digits, another program), a free port
# the kernel picks is used instead, and the log says so; srun passes it to the processes of every node.
export MAIN_HOST=${MAIN_HOST:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
if [ -z "${MAIN_PORT:-}" ]; then
    MAIN_PORT=$((15000 + SLURM_JOB_ID % 10000))
    if (exec 3<>"/dev/tcp/$MAIN_HOST/$MAIN_PORT") 2>/dev/null; then  # something answers there
        taken=$MAIN_PORT
        MAIN_PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
        echo "$(date -u +%FT%T) job $JOB: port $taken is in use on $MAIN_HOST; its processes meet at port $MAIN_PORT"
    fi
    export MAIN_PORT
fi

# `run_requeued COMMAND...` runs COMMAND (an srun) and returns its status. SIGUSR1 to the batch script
# (#SBATCH --signal=B:USR1@N ahead of the time limit, or `scancel --signal=USR1 --batch JOB`) becomes SIGTERM to
# every process of the job's steps (scancel --signal: the steps go on until their processes exit): train.py
# checkpoints and exits 75, and the job goes back to the queue. Not `kill -TERM` of srun: srun answers its own
# SIGTERM by killing the step with SIGKILL at once. A status of 75 (train.py stopped by a signal that reached
# the step itself: `scancel --signal=TERM JOB`, `--signal=USR1@N` without B:) requeues the job as well: train.py's
# own under train_tasks.sbatch, torchrun.sh's (which carries it past torchrun) under train.sbatch and
# train_array.sbatch.
run_requeued() {
    local stopped='' status
    trap 'stopped=1; echo "$(date -u +%FT%T) job $JOB: SIGUSR1, SIGTERM to its steps"
          scancel --signal=TERM "$JOB"' USR1
    "$@" &
    child=$!
    wait "$child"
    status=$?
    while kill -0 "$child" 2>/dev/null; do  # the trap ended `wait`: wait for the checkpoint
        wait "$child"
        status=$?
    done
    echo "$(date -u +%FT%T) job $JOB (restart ${SLURM_RESTART_COUNT:-0}): $1 exited with $status"
    if { [ -n "$stopped" ] && [ "$status" -ne 0 ]; } || [ "$status" -eq 75 ]; then
        scontrol requeue "$JOB"
    fi
    return "$status"
}
