#!/bin/sh
# trainguard release hook for Slurm: resume a drained node once its blocklist entry ended.
#   TRAINGUARD_RELEASE_HOOK="/opt/trainguard/hooks/slurm-release.sh {host}"
set -eu
host="$1"
scontrol update "NodeName=$host" State=RESUME
