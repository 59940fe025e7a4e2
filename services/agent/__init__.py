"""The node agent: ``trainguard launch`` runs a node's ranks under torch's elastic
launcher and is the outside hand for what a rank cannot do itself (restart, isolate,
stack dumps, kill/freeze drills, exit reports, GPU telemetry)."""
