"""The detector: hangs, crashes, stragglers, bad numerics and SDC, with the culprit rank.

Pure rules over per-job state (``thresholds``, ``windows``, ``job``, ``liveness``,
``performance``, ``numerics``, ``hardware``, ``book``, ``engine``) and a thin async shell
(``service``, ``leases``) that feeds them from NATS and writes what they find to the bus
and to Redis. The rules never do I/O, so every one of them is tested on synthetic streams.
"""
