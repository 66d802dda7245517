# Sourced by the batch scripts in this folder (from the folder sbatch ran in, the repository's root).
# `run_requeued COMMAND...` runs COMMAND (an srun) and returns its status. SIGUSR1 to the batch script
# (#SBATCH --signal=B:USR1@N ahead of the time limit, or `scancel --signal=USR1 --batch JOB`) becomes SIGTERM to
# every process of the job's steps (scancel --signal: the steps go on until their processes exit): train.py
# checkpoints and exits 75, and the job goes back to the queue. Not `kill -TERM` of srun: srun answers its own
# SIGTERM by killing the step with SIGKILL at once. A status of 75 (train.py stopped by a signal that reached
# the step itself) requeues the job as well.
run_requeued() {
    local stopped='' status
    trap 'stopped=1; echo "$(date -u +%FT%T) job $SLURM_JOB_ID: SIGUSR1, SIGTERM to its steps"
          scancel --signal=TERM "$SLURM_JOB_ID"' USR1
    "$@" &
    child=$!
    wait "$child"
    status=$?
    while kill -0 "$child" 2>/dev/null; do  # the trap ended `wait`: wait for the checkpoint
        wait "$child"
        status=$?
    done
    echo "$(date -u +%FT%T) job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $1 exited with $status"
    if { [ -n "$stopped" ] && [ "$status" -ne 0 ]; } || [ "$status" -eq 75 ]; then
        scontrol requeue "$SLURM_JOB_ID"
    fi
    return "$status"
}
