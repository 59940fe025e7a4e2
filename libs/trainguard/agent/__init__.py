"""The node agent: ``trainguard launch`` runs a node's ranks under torch's elastic
launcher and is the outside hand for what a rank cannot do itself (restart, isolate,
stack dumps, kill/freeze drills, exit reports, GPU telemetry).

Not a bus service (it runs on every training host, beside the ranks), so it has its own
place: it imports the contract, core, the runtime (bus, store, metrics), the recovery (the
group store it serves) and the analysis; never the client, the torch helpers or a service.
Its `trainguard launch` needs the ``agent`` extra.
"""
