"""The JetStream topology (streams and consumers) as data, provisioned idempotently.

Why each stream looks the way it does is in docs/design.md, section 3; in short:

* ``EVENTS``: anomalies, diagnoses, actions, incidents, checkpoints; kept for days so
  alerting tools can replay; limits retention.
* ``CMDS``: commands; *interest* retention, since a work-queue stream refuses the
  overlapping filters that a broadcast to ``cmd.all`` needs. A command published before
  any consumer exists is dropped, which is why agents bind before saying hello.
* ``REPORTS``: acks, worker exits, checkpoint reports, hellos, recovery reports.
* ``DEAD``: ``<prefix>.*.dead`` plus JetStream's max-deliveries and terminated
  advisories (JetStream has no dead-letter queue of its own).

Stream names derive from the subject prefix (``tg`` -> ``TG_EVENTS``), so two
deployments with different prefixes can share one server.

Every stream and durable consumer gets ``replicas`` copies (``TRAINGUARD_STREAM_REPLICAS``):
1 on one server, 3 on a 3-node cluster, where a stream then survives the loss of any one
node (its Raft group elects a new leader; acknowledged messages are on a quorum).
Provisioning scales an existing stream to the configured count instead of failing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, NotFoundError

from trainguard.contract.errors import ConfigError
from trainguard.contract.subjects import StreamRole, Subjects, stream_name
from trainguard.core.identities import agent_durable

DAY: Final = 86400.0


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    role: StreamRole
    name: str
    subjects: tuple[str, ...]
    retention: js_api.RetentionPolicy
    storage: js_api.StorageType
    max_age: float
    duplicate_window: float = 120.0
    max_msg_size: int = 1024 * 1024
    replicas: int = 1

    def config(self) -> js_api.StreamConfig:
        return js_api.StreamConfig(
            name=self.name,
            num_replicas=self.replicas,
            subjects=list(self.subjects),
            retention=self.retention,
            storage=self.storage,
            max_age=self.max_age,
            duplicate_window=self.duplicate_window,
            max_msg_size=self.max_msg_size,
        )


@dataclasses.dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer: every replica of a service binds the same one.

    ``max_deliver`` is unlimited on the server: the service base decides when a message
    has failed often enough to be dead-lettered, so a dependency that is down for a
    while (Redis) delays messages instead of losing them.
    """

    stream: StreamRole
    durable: str
    filter_subjects: tuple[str, ...]
    ack_wait: float = 30.0
    max_ack_pending: int = 1000
    deliver_new: bool = False
    inactive_threshold: float | None = None

    def config(self, replicas: int = 1) -> js_api.ConsumerConfig:
        return js_api.ConsumerConfig(
            durable_name=self.durable,
            num_replicas=replicas,
            ack_policy=js_api.AckPolicy.EXPLICIT,
            deliver_policy=js_api.DeliverPolicy.NEW if self.deliver_new
            else js_api.DeliverPolicy.ALL,
            ack_wait=self.ack_wait,
            max_deliver=-1,
            max_ack_pending=self.max_ack_pending,
            filter_subjects=list(self.filter_subjects),
            inactive_threshold=self.inactive_threshold,
        )


def agent_consumer(prefix: str, job: str, host: str) -> ConsumerSpec:
    """The durable command consumer of ``host``'s agent in ``job``: the job's broadcasts
    and its own host's commands, in the stream's order. Made by the agent itself, or in
    ``jwt`` mode by the control plane at its agent's ask (:mod:`trainguard.runtime.issuer`):
    an agent's own credential may not create a consumer, whose filters no permission can
    name."""
    s = Subjects(prefix)
    return ConsumerSpec("cmds", agent_durable(job, host),  # jwt permissions name it
                        (s.cmd_all(job), s.cmd_host(job, host)),
                        ack_wait=120.0, inactive_threshold=3600.0)


def streams(prefix: str, *, replicas: int = 1,
            telemetry_capture: bool = False) -> list[StreamSpec]:
    """The streams of one deployment, in the order they are provisioned."""
    s = Subjects(prefix)
    limits, interest = js_api.RetentionPolicy.LIMITS, js_api.RetentionPolicy.INTEREST
    file, memory = js_api.StorageType.FILE, js_api.StorageType.MEMORY
    names = {role: stream_name(prefix, role) for role in ("events", "cmds", "reports")}
    advisories = tuple(
        f"$JS.EVENT.ADVISORY.CONSUMER.{what}.{name}.*"
        for name in names.values()
        for what in ("MAX_DELIVERIES", "MSG_TERMINATED")
    )
    specs = [
        StreamSpec("events", names["events"], (s.pattern("event", tail=">"),), limits, file,
                   7 * DAY),
        StreamSpec("cmds", names["cmds"], (s.pattern("cmd", tail=">"),), interest, file, DAY),
        StreamSpec("reports", names["reports"],
                   tuple(s.pattern(k) for k in ("ack", "exit", "fr", "ckpt", "reg", "recovery")),
                   limits, file,
                   7 * DAY),
        StreamSpec("dead", stream_name(prefix, "dead"), (s.dead_pattern(), *advisories),
                   limits, file, 14 * DAY),
    ]
    if telemetry_capture:
        specs.append(StreamSpec(
            "telemetry", stream_name(prefix, "telemetry"),
            tuple(s.pattern(k, tail=">") for k in ("hb", "step", "fp", "gpu", "node")),
            limits, memory, 600.0, duplicate_window=0.0))
    return [dataclasses.replace(spec, replicas=replicas) for spec in specs]


def _differs(want: js_api.StreamConfig, have: js_api.StreamConfig) -> bool:
    fields: tuple[str, ...] = ("subjects", "retention", "storage", "max_age", "max_msg_size",
                               "duplicate_window", "num_replicas")
    current: dict[str, Any] = {f: getattr(have, f) for f in fields}
    current["subjects"] = sorted(current["subjects"] or [])
    wanted: dict[str, Any] = {f: getattr(want, f) for f in fields}
    wanted["subjects"] = sorted(wanted["subjects"] or [])
    return current != wanted


async def provision(js: JetStreamContext, specs: list[StreamSpec]) -> list[str]:
    """Create each stream, or update it where its config differs. Returns what changed.

    ``add_stream`` with a different config fails (JetStream error 10058), hence "add,
    else compare and update". More replicas than the server can hold (one server, or a
    cluster smaller than the count) is a :class:`ConfigError` naming the setting.
    """
    changed: list[str] = []
    for spec in specs:
        want = spec.config()
        try:
            try:
                info = await js.stream_info(spec.name)
            except NotFoundError:
                await js.add_stream(want)
                changed.append(f"created {spec.name}")
                continue
            if _differs(want, info.config):
                await js.update_stream(want)
                changed.append(f"updated {spec.name}")
        except APIError as exc:
            refused = _replicas_refused(spec.name, spec.replicas, exc)
            if refused is None:
                raise
            raise refused from None
    return changed


_REPLICA_ERRORS: Final = (10074, 10005)
"""JetStream's "replicas > 1 not supported in non-clustered mode" and "insufficient
resources" (fewer servers than replicas)."""


def _replicas_refused(what: str, replicas: int, exc: APIError) -> ConfigError | None:
    """A clear error where the server refused ``replicas`` copies of ``what``."""
    if replicas <= 1 or exc.err_code not in _REPLICA_ERRORS:
        return None
    return ConfigError(
        f"NATS refused {replicas} replicas of {what} ({exc.description}): "
        f"TRAINGUARD_STREAM_REPLICAS={replicas} needs a JetStream cluster of at least "
        f"{replicas} servers; set it to 1 for a single nats-server")


async def missing_streams(js: JetStreamContext, specs: list[StreamSpec]) -> list[str]:
    """Names of the streams not provisioned yet: what a client that may not create
    streams (an agent) waits for instead of calling :func:`provision`."""
    missing = []
    for spec in specs:
        try:
            await js.stream_info(spec.name)
        except NotFoundError:
            missing.append(spec.name)
    return missing


async def ensure_consumer(js: JetStreamContext, prefix: str, spec: ConsumerSpec,
                          replicas: int | None = None) -> str:
    """Create or update a durable consumer explicitly; returns its stream's name.

    ``pull_subscribe`` would silently keep an existing durable's old config, so the
    config is always (re)applied before binding, ``replicas`` included (None: as many as
    its stream has, for clients such as agents that do not provision the streams).
    """
    name = stream_name(prefix, spec.stream)
    if replicas is None:
        replicas = (await js.stream_info(name)).config.num_replicas or 1
    await js.add_consumer(name, spec.config(replicas))
    return name
