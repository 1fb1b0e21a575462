#!/usr/bin/env bash
# A real SLURM cluster on this machine for the SlurmJob tests: slurmctld + two slurmd posing as nodes n1, n2
# (see the shared notes on SLURM). Needs root and Debian's packages; installs them when missing.
#   source .ci/slurm.sh start   # exports SLURM_CONF; on any failure prints why and returns 0 (tests then skip)
#   bash .ci/slurm.sh stop      # scancel everything, stop the daemons it started (by their PIDs)
# A second cluster on the same machine (another checkout's CI) takes another directory and ports:
#   MONARCH_TENSOR_SLURM_DIR=/tmp/s2 MONARCH_TENSOR_SLURM_PORT=6827 source .ci/slurm.sh start
DIR=${MONARCH_TENSOR_SLURM_DIR:-/tmp/monarch-tensor-slurm}
PORT=${MONARCH_TENSOR_SLURM_PORT:-6817}  # slurmctld's; the two slurmd listen on PORT + 10184 and + 10185

_slurm_start() {
  if [ "$(id -u)" != 0 ]; then echo "slurm: not root, skipping the SLURM set-up"; return 1; fi
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge) >/dev/null 2>&1 || { echo "slurm: apt-get install failed"; return 1; }
  fi
  mkdir -p "$DIR"/state "$DIR"/spool "$DIR"/log /run/munge
  chown munge:munge /run/munge 2>/dev/null || true
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    [ -f /etc/munge/munge.key ] || { echo "slurm: no /etc/munge/munge.key"; return 1; }
    setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F >"$DIR/log/munged.log" 2>&1 &
    echo $! > "$DIR/munged.pid"
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  fi
  local host cpus
  host=$(hostname -s); cpus=$(nproc)
  cat > "$DIR/slurm.conf" <<CONF
ClusterName=ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=$PORT
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
EnforcePartLimits=ALL
SlurmdParameters=config_overrides
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 10184)) CPUs=$cpus RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 10185)) CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF="$DIR/slurm.conf"
  if sinfo -h -t idle -o %D 2>/dev/null | grep -qx 2; then echo "slurm: already running"; return 0; fi
  slurmctld -D >"$DIR/log/slurmctld.out" 2>&1 & echo $! > "$DIR/ctld.pid"
  slurmd -D -N n1 >"$DIR/log/n1.out" 2>&1 & echo $! > "$DIR/n1.pid"
  slurmd -D -N n2 >"$DIR/log/n2.out" 2>&1 & echo $! > "$DIR/n2.pid"
  for _ in $(seq 150); do
    [ "$(sinfo -h -t idle -o %D 2>/dev/null)" = 2 ] && { echo "slurm: 2 nodes idle"; return 0; }
    sleep 0.2
  done
  echo "slurm: nodes did not become idle; SLURM tests will skip"; return 1
}

_slurm_stop() {
  export SLURM_CONF="$DIR/slurm.conf"
  scancel --user=root >/dev/null 2>&1 || true
  for f in n1 n2 ctld munged; do
    [ -f "$DIR/$f.pid" ] && kill "$(cat "$DIR/$f.pid")" 2>/dev/null; rm -f "$DIR/$f.pid"
  done
  return 0
}

case "${1:-}" in
  start) _slurm_start || unset SLURM_CONF ;;
  stop) _slurm_stop ;;
  *) echo "usage: source .ci/slurm.sh start | bash .ci/slurm.sh stop" >&2 ;;
esac
true
