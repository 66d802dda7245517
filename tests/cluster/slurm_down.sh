#!/usr/bin/env bash
# Stop the Slurm of tests/cluster/slurm_up.sh: cancel every job, then stop both slurmd, slurmctld and munged (each by
# the pid it recorded) and wait until they are gone.
set -uo pipefail
root=${VCA_SLURM_DIR:-/tmp/vca-slurm}
export SLURM_CONF=$root/slurm.conf
[ -f "$SLURM_CONF" ] && timeout 10 scancel --full --quiet --user "$(id -un)" 2>/dev/null
for daemon in slurmd-node1 slurmd-node2 slurmctld munge/munged; do
    pidfile=$root/$daemon.pid
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null
    rm -f "$pidfile"
done
echo "slurm_down.sh: stopped"
