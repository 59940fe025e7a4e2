"""Environment variable names that cross the agent → rank boundary, spelled once.

``trainguard launch`` sets these for its ranks and ``trainguard.Guard`` reads them, so
``Guard()`` needs no arguments under the launcher; torchrun's own names (``RANK``, ...)
are here because the client reads them too. Every trainguard setting is
``TRAINGUARD_<FIELD>`` (:func:`setting`), the same rule :mod:`trainguard.runtime.config` applies to
the services' settings, which is why ``JOB``, ``HOST``, ``NATS_URL``, ``SUBJECT_PREFIX`` and
``ALLOW_DRILLS`` are also the agent's own settings fields of the same names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

PREFIX: Final = "TRAINGUARD_"


def setting(field: str) -> str:
    """The environment variable of a settings field: ``nats_url`` → ``TRAINGUARD_NATS_URL``."""
    return PREFIX + field.upper()


# -- set by ``trainguard launch`` for its ranks, read by the Guard -----------------------
JOB: Final = setting("job")
HOST: Final = setting("host")
NATS_URL: Final = setting("nats_url")
SUBJECT_PREFIX: Final = setting("prefix")
"""The subject and key prefix (``tg``), not :data:`PREFIX`."""
ALLOW_DRILLS: Final = setting("allow_drills")
CREDENTIALS: Final = setting("credentials")
"""The rank role's credentials file (the agent's ``rank_credentials``)."""
NATS_TLS_CA: Final = setting("nats_tls_ca")
FR_REQUEST: Final = setting("fr_request")
"""The file the agent writes a request id to when it wants the ranks' flight-recorder dumps
(:mod:`trainguard.client.frdump`)."""
GENERATION: Final = setting("generation")
"""The job's process-group generation the rank joins (rises at every new group and at
every single-rank restart)."""
JOIN: Final = setting("join")
"""``peers``: the rank replaces a failed one in a running group and takes model, optimizer
and step from the survivors (``trainguard.torch``'s in-place recovery), not from a
checkpoint."""
JOIN_PEERS: Final = "peers"
"""The :data:`JOIN` value of a replacement rank."""
RESTART_STAMPS: Final = setting("restart_stamps")
"""The agent's side of the group restart that started the rank (JSON,
:class:`trainguard.contract.timeline.RestartStamps`)."""

# -- read by the Guard only --------------------------------------------------------------
DISABLED: Final = setting("disabled")
CHECKPOINT_ROOT: Final = setting("checkpoint_root")
"""Where ``<root>/<job>/LATEST`` lives when the coordinator cannot be asked."""
REDIS_URL: Final = setting("redis_url")
BATCH_CHECK_EVERY: Final = setting("batch_check_every")
"""Steps between batch checks (``trainguard.torch.BatchCheck``; 0: never, default 1)."""
BAD_BATCH: Final = setting("bad_batch")
"""``skip`` (every rank skips a step whose batch is bad anywhere) or ``report``."""
CHECKPOINT_INCREMENTAL: Final = setting("checkpoint_incremental")
"""Incremental saves between full ones (``trainguard.torch.Checkpointer``; 0: none, the
default)."""
SNAPSHOT_BUDDY: Final = setting("snapshot_buddy")
"""``1``: each rank sends its memory snapshots to a buddy rank on another host and keeps
its buddy's (``trainguard.torch.buddy``); off by default."""
SNAPSHOT_BUDDY_ADDR: Final = setting("snapshot_buddy_addr")
"""The address a rank's buddy listener binds and advertises (default: this host's address
as the hostname resolves it)."""
FAST_EXIT: Final = setting("fast_exit")
"""``0`` keeps other libraries' exit handlers on a crash in place (``trainguard.client.
fastexit``); on by default."""

# -- torchrun's, read by the Guard -------------------------------------------------------
RANK: Final = "RANK"
WORLD_SIZE: Final = "WORLD_SIZE"
LOCAL_RANK: Final = "LOCAL_RANK"
RESTART_COUNT: Final = "TORCHELASTIC_RESTART_COUNT"
"""The attempt: torchrun's restarts of the worker group so far."""

ACCESS: Final = frozenset(setting(f) for f in (
    "credentials", "rank_credentials", "nats_creds", "nats_nkey", "nats_tls_ca",
    "nats_tls_cert", "nats_tls_key", "redis_tls_ca", "redis_tls_cert", "redis_tls_key"))
"""Who a process is to the servers (:class:`trainguard.runtime.config.Settings` fields): never
inherited from the agent by its ranks except as the agent hands them on, never published."""
CONNECTION: Final = frozenset({NATS_URL, REDIS_URL, SUBJECT_PREFIX, JOB, HOST, GENERATION,
                               JOIN, RESTART_STAMPS, FR_REQUEST, *ACCESS})
"""Where and who (and which incarnation, and this node's dump-request file), not how to
judge the job: kept out of
:func:`job_settings`."""

GUARD_KEYS: Final = frozenset({JOB, HOST, NATS_URL, SUBJECT_PREFIX, ALLOW_DRILLS, CREDENTIALS,
                               NATS_TLS_CA, FR_REQUEST, GENERATION, JOIN, RESTART_STAMPS,
                               DISABLED, CHECKPOINT_ROOT, REDIS_URL, FAST_EXIT,
                               BATCH_CHECK_EVERY, BAD_BATCH, CHECKPOINT_INCREMENTAL,
                               SNAPSHOT_BUDDY, SNAPSHOT_BUDDY_ADDR})
"""The names the Guard reads (above). With every settings field's name they are what
:func:`trainguard.runtime.config.known_variables` accepts; the per-job keys a job forwards in its
hello (:func:`job_settings`) are detector settings (``TRAINGUARD_HANG_FLOOR``), known as
such."""

TRUE: Final = ("1", "true", "yes", "on")
FALSE: Final = ("0", "false", "no", "off")


def flag(env: Mapping[str, str], name: str) -> bool:
    """A boolean variable: ``1``/``true``/``yes``/``on`` (any case) is true."""
    return env.get(name, "").lower() in TRUE


def job_settings(env: Mapping[str, str]) -> dict[str, str]:
    """``TRAINGUARD_*`` settings the job carries in its hello (per-job detector thresholds
    such as ``TRAINGUARD_HANG_FLOOR``); connection details stay out."""
    return {k: v for k, v in env.items() if k.startswith(PREFIX) and k not in CONNECTION}
