#!/bin/sh
# trainguard isolate hook for Slurm: drain the node (running steps end, no new job lands).
#   TRAINGUARD_ISOLATE_HOOK="/opt/trainguard/hooks/slurm-isolate.sh {host} {reason}"
# HOST is the agent's --host ($SLURMD_NODENAME in the sbatch example). Runs where
# `scontrol` reaches slurmctld as a user allowed to update nodes (SlurmUser or an operator).
set -eu
host="$1"
reason="${2:-isolated by trainguard}"
scontrol update "NodeName=$host" State=DRAIN "Reason=trainguard: $reason"
