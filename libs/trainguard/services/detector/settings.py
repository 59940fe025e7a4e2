"""The detector's settings: the shared ones, every rule threshold, and its own mechanics.

Loaded like every trainguard config: defaults, then ``TRAINGUARD_<FIELD>`` environment
variables, then CLI overrides; an unknown key is an error. The rule thresholds are the
fields of :class:`~.thresholds.Thresholds` (documented there and in the README).
"""

from __future__ import annotations

import dataclasses

from trainguard.runtime.config import Settings

from .thresholds import Thresholds


@dataclasses.dataclass(frozen=True, kw_only=True)
class DetectorSettings(Settings, Thresholds):
    """Settings of one detector process."""

    tick_interval: float = 0.25
    """How often time-based rules run: bounds the detection delay of silence and hangs."""
    progress_interval: float = 1.0
    """How often ``progress:<job>`` is written to Redis (pipelined, all jobs at once)."""
    lease_ttl: float = 10.0
    """A dead detector's jobs move to another within this long."""
    lease_interval: float = 2.0
    """How often leases are renewed and free jobs looked for (well under the TTL)."""
    peer_probe_interval: float = 0.5
    """How often the detector asks after the other detectors that own jobs (their NATS
    presence, :mod:`trainguard.runtime.presence`); one gone is taken over after two
    answers in a row, instead of after ``lease_ttl``. 0: never (leases expire)."""
    job_idle_expiry: float = 3600.0
    """A job silent this long is let go (state dropped, lease released)."""
    instance_id: str = ""
    """This instance's name in leases, stable across its restarts so that a restarted
    detector takes its jobs back at once; empty: the host name (``<host>:<health_port>``
    when the health port is fixed). Two live detectors never share one (see
    :mod:`.identity`)."""
    bus_probe_interval: float = 0.5
    """How often the detector times a PING/PONG round trip to its NATS server."""
    bus_stale_after: float = 2.0
    """No answered probe sent within this long: the bus is stalled, and silence proves
    nothing (keep it under ``hb_timeout`` minus the ranks' beat period)."""
    redis_wait: float = 0.5
    """How long an anomaly change waits to be stored in Redis before it is published
    anyway (detection never waits longer for Redis)."""
    retry_delay: float = 0.5
    """Redelivery delay for a durable message of a job this detector may not take now (no
    live owner known: the job is free, or its owner's lease has yet to expire)."""
    fetch_wait: float = 0.25
    """How long one pull request waits for messages (the base setting's 1 s): a replica's
    pull request keeps receiving until it expires, so a message this detector hands back
    (another owns its job) tends to come back to it until then, again and again (in a storm
    of another job's exits a crash reached its owner 1.1-1.3 s late at 1 s)."""
    owned_retry_delay: float = 0.05
    """Redelivery delay for a durable message of a job a live detector owns: it goes back
    at once for its owner to fetch (each bounce adds this to the message's latency)."""
