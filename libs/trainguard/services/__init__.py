"""The control-plane services, one folder each (detector, diagnoser, checkpointer,
remediator, bridge): rules as pure functions and classes, a thin async shell on
:mod:`trainguard.runtime`.

A service imports the contract, core, the runtime and the analysis; never another service
(import-linter's independence contract), the client, the recovery or torch. The CLI finds
them through the ``trainguard.services`` entry points. They need the ``services`` extra.
"""
