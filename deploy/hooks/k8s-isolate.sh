#!/bin/sh
# trainguard isolate hook for Kubernetes: keep new pods off an isolated node.
#   TRAINGUARD_ISOLATE_HOOK="/opt/trainguard/hooks/k8s-isolate.sh {host} {reason}"
# Cordons the node, taints it NoSchedule (running pods stay: the agent has already stopped
# its workers) and notes the reason. HOST is the agent's --host: the node name, or the node
# name with dots written as dashes (a subject token has no dots). Needs RBAC to get, list
# and patch nodes (the chart's remediator ServiceAccount has it).
set -eu
host="$1"
reason="${2:-isolated by trainguard}"
# shellcheck source=k8s-node.sh
. "$(dirname "$0")/k8s-node.sh"
node=$(node_of "$host")
if [ -z "$node" ]; then
    echo "k8s-isolate: no node is named $host" >&2
    exit 3
fi
kubectl cordon "$node"
kubectl taint nodes "$node" trainguard.io/isolated=true:NoSchedule --overwrite
kubectl annotate nodes "$node" "trainguard.io/isolated-reason=$reason" --overwrite
