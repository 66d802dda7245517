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

mkdir -p "$root"/{state,spool,log,munge,dev}
for gpu in 0 1 2 3 4 5 6 7; do ln -sfn /dev/null "$root/dev/gpu$gpu"; done  # Slurm wants character devices
chmod 700 "$root/munge"
if [ ! -s "$root/munge/munge.key" ]; then
    dd if=/dev/urandom of="$root/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$root/munge/munge.key"
fi
host=$(hostname -s)
# Two nodes on this one host (two slurmd, each on its own port, both at 127.0.0.1), so that a job can span two
# "nodes" as on a cluster. Each declares itself an 8-GPU node, whatever the machine has (config_overrides: slurmd
# takes the declared values): 128 CPUs, 1 TB of memory and 8 GPUs whose device files are links to /dev/null, so
# that the batch scripts of docs/slurm/ are submitted with the resources they request (tests/test_slurm.py lowers
# the GPU count, and the processes with it, to what a 2-core CI machine runs; the tests' tasks are tiny).
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
GresTypes=gpu
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
SlurmdSpoolDir=$root/spool/%n
SlurmctldPidFile=$root/slurmctld.pid
SlurmdPidFile=$root/slurmd-%n.pid
SlurmctldLogFile=$root/log/slurmctld.log
SlurmdLogFile=$root/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=node[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=6821-6822 CPUs=128 RealMemory=1000000 Gres=gpu:8 State=UNKNOWN
PartitionName=test Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
echo "NodeName=node[1-2] Name=gpu File=$root/dev/gpu[0-7]" > "$root/gres.conf"

if [ ! -S "$root/munge/munge.socket" ] || ! munge -n -S "$root/munge/munge.socket" >/dev/null 2>&1; then
    munged --force --key-file "$root/munge/munge.key" --socket "$root/munge/munge.socket" \
        --pid-file "$root/munge/munged.pid" --log-file "$root/log/munged.log" --seed-file "$root/munge/munged.seed"
fi
pgrep -F "$root/slurmctld.pid" >/dev/null 2>&1 || slurmctld -f "$SLURM_CONF"
for node in node1 node2; do
    mkdir -p "$root/spool/$node"
    pgrep -F "$root/slurmd-$node.pid" >/dev/null 2>&1 || slurmd -f "$SLURM_CONF" -N "$node"
done
for _ in $(seq 1 60); do
    if [ "$(timeout 5 sinfo -h -o '%T %D' 2>/dev/null)" = "idle 2" ]; then
        echo "slurm_up.sh: Slurm up, nodes node1 and node2 on $host ($SLURM_CONF)"
        exit 0
    fi
    sleep 0.5
done
echo "slurm_up.sh: the node did not become idle in 30 s; see $root/log/" >&2
sinfo >&2 || true
exit 1
