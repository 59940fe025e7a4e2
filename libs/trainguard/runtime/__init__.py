"""The control plane's shared runtime: the bus, the service base and its settling of
deliveries, the Redis store and state records, configuration, health and metrics endpoints,
leases, logs, embedded servers, the reference tables (the Xid catalog) and the readers of
the failure domains.

Used by the services, the node agent and the CLI; never by a rank (the client, the recovery
and the torch helpers are forbidden to import it). Imports :mod:`trainguard.contract` and
:mod:`trainguard.core`.
"""
