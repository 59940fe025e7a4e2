#!/bin/sh
# Sourced by the Kubernetes hooks: node_of HOST prints the node the agent's HOST names (the
# node name itself, or the node name with dots written as dashes: a subject token has no
# dots), or nothing.
node_of() {
    kubectl get nodes -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' |
        awk -v h="$1" '{ n = $0; gsub(/\./, "-", n) } $0 == h || n == h { print $0; exit }'
}
