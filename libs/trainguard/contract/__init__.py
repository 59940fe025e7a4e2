"""The contract: every vocabulary that crosses a process boundary, as data.

Subjects, message schemas, anomaly evidence, RPC bodies, envelope headers and ids, the
codec, command targets, environment variable names, errors, the JetStream topology, the
checkpoint commit record, an increment's chain and the failure domains (which hosts go
down together). Data only: it imports nothing else of trainguard and nothing that runs
(no NATS, Redis or torch), so every side (rank, agent, service, CLI) can load it.
"""
