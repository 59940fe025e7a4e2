#!/bin/sh
# trainguard release hook for Kubernetes: give a node back once its blocklist entry ended
# (its TTL, or `trainguard unblock HOST`).
#   TRAINGUARD_RELEASE_HOOK="/opt/trainguard/hooks/k8s-release.sh {host}"
set -eu
host="$1"
# shellcheck source=k8s-node.sh
. "$(dirname "$0")/k8s-node.sh"
node=$(node_of "$host")
if [ -z "$node" ]; then
    echo "k8s-release: no node is named $host (gone: nothing to give back)" >&2
    exit 0
fi
# The taint may be gone already (removed by hand): that is not a failure.
kubectl taint nodes "$node" trainguard.io/isolated:NoSchedule- || true
kubectl annotate nodes "$node" trainguard.io/isolated-reason- || true
kubectl uncordon "$node"
