#!/usr/bin/env bash
# Bring up a single-host Slurm (Debian's slurm-wlm and munge) for the tests: munged, slurmctld and slurmd, with
# their key, configuration, state and logs under one folder ($VCA_SLURM_DIR, default /tmp/vca-slurm). Idempotent:
# when the controller already answers, it only says so. Installs the packages first when they are missing and
# this runs as root (CI). Clients find this cluster through SLURM_CONF=$VCA_SLURM_DIR/slurm.conf.
# tests/cluster/slurm_down.sh stops it again (and cancels every job).
set -euo pipefail
root=${VCA_SLURM_DIR:-/tmp/vca-slurm}
export SLURM_CONF=$root/slurm.conf

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "slurm_up.sh: slurmctld/munged are not installed (apt-get install slurm-wlm munge, as root)" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi
if [ -f "$SLURM_CONF" ] && timeout 5 sinfo -h -o %T >/dev/null 2>&1; then
    echo "slurm_up.sh: Slurm already up ($SLURM_CONF)"
    exit 0
fi

mkdir -p "$root"/{state,spool,log,munge}
chmod 700 "$root/munge"
if [ ! -s "$root/munge/munge.key" ]; then
    dd if=/dev/urandom of="$root/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$root/munge/munge.key"
fi
host=$(hostname -s)
# The node declares 8 CPUs on whatever the machine has (config_overrides: slurmd takes the declared values), so
# that two jobs of 2-4 tasks fit on a 2-core CI machine; the tests' tasks are tiny.
cat > "$SLURM_CONF" <<CONF
ClusterName=vca-test
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$root/munge/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobRequeue=1
KillWait=30
MinJobAge=300
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$root/state
SlurmdSpoolDir=$root/spool
SlurmctldPidFile=$root/slurmctld.pid
SlurmdPidFile=$root/slurmd.pid
SlurmctldLogFile=$root/log/slurmctld.log
SlurmdLogFile=$root/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$host CPUs=8 RealMemory=4096 State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

if [ ! -S "$root/munge/munge.socket" ] || ! munge -n -S "$root/munge/munge.socket" >/dev/null 2>&1; then
    munged --force --key-file "$root/munge/munge.key" --socket "$root/munge/munge.socket" \
        --pid-file "$root/munge/munged.pid" --log-file "$root/log/munged.log" --seed-file "$root/munge/munged.seed"
fi
pgrep -F "$root/slurmctld.pid" >/dev/null 2>&1 || slurmctld -f "$SLURM_CONF"
pgrep -F "$root/slurmd.pid" >/dev/null 2>&1 || slurmd -f "$SLURM_CONF"
for _ in $(seq 1 60); do
    if [ "$(timeout 5 sinfo -h -o %T 2>/dev/null)" = "idle" ]; then
        echo "slurm_up.sh: Slurm up on $host ($SLURM_CONF)"
        exit 0
    fi
    sleep 0.5
done
echo "slurm_up.sh: the node did not become idle in 30 s; see $root/log/" >&2
sinfo >&2 || true
exit 1
