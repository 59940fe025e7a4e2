"""The remediator on real NATS and Redis, with a stand-in for the node agents that runs
the agent's own command rules (CommandExecutor) and acknowledges like an agent."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from tests.conftest import wait_until
from tests.integration.recorder import running
from tests.unit.test_agent_rules import FakeNode
from trainguard.agent.executor import CommandExecutor
from trainguard.contract.codec import decode_durable, encode_durable
from trainguard.contract.rpc import RESUME, SAVE, SaveReply, SaveRequest
from trainguard.contract.schemas import (
    Action,
    Command,
    CommandAck,
    Diagnosis,
    EvidenceItem,
    Incident,
    NodeHello,
    RankHello,
    ResumePoint,
    WorkerExit,
)
from trainguard.contract.subjects import Subjects
from trainguard.core.connection import flush
from trainguard.runtime.bus import Bus
from trainguard.runtime.config import load_settings
from trainguard.runtime.embedded import free_port
from trainguard.runtime.state import (
    Keys,
    NodeRecord,
    Progress,
    decode_blocklist_entry,
    decode_node_record,
    encode_node_record,
    encode_progress,
)
from trainguard.runtime.topology import provision, stream_name, streams
from trainguard.services.remediator.engine import CRASHING
from trainguard.services.remediator.service import RemediatorService
from trainguard.services.remediator.settings import RemediatorSettings


class Agents:
    """Two hosts' agents: the real executor rules over a fake worker table."""

    def __init__(self, nc: Any, prefix: str, job: str, *, drop_first_ack: bool = False) -> None:
        self.nc, self.s, self.job = nc, Subjects(prefix), job
        self.bus = Bus(nc, self.s, source="test-agent")
        self.nodes = {h: FakeNode(host=h, hosts_store=h == "node-a", pids=pids)
                      for h, pids in (("node-a", {0: 1000, 1: 1001}),
                                      ("node-b", {2: 1002, 3: 1003}))}
        self.executors = {h: CommandExecutor(n) for h, n in self.nodes.items()}
        self.commands: list[Command] = []
        self.drop_first_ack = drop_first_ack

    async def start(self) -> None:
        for host in self.nodes:
            async def cb(msg: Any, host: str = host) -> None:
                cmd = decode_durable(msg.data, Command)
                if cmd.id not in {c.id for c in self.commands}:
                    self.commands.append(cmd)
                out = self.executors[host].handle(cmd)
                if out is None or (self.drop_first_ack and cmd.id == self.commands[0].id):
                    return  # this ack is lost
                await self.bus.publish_durable(self.s.ack(self.job, cmd.issuer), CommandAck(
                    command_id=cmd.id, job=self.job, responder=f"host-{host}",
                    outcome=out.outcome, detail=out.detail, kind=cmd.kind))

            await self.nc.subscribe(self.s.cmd_all(self.job), cb=cb)
            await self.nc.subscribe(self.s.cmd_host(self.job, host), cb=cb)
        await flush(self.nc)

    def executed(self, kind: str) -> set[str]:
        """Ids of the ``kind`` commands the nodes actually ran (a broadcast counts once)."""
        return {c.split(":", 1)[1] for n in self.nodes.values() for c in n.calls
                if c.startswith(kind + ":")}


async def seed(redis_url: str, prefix: str, job: str, *, attempt: int, step: int,
               generation: int = 0) -> None:
    keys = Keys(prefix)
    r = aioredis.Redis.from_url(redis_url)
    for host, store in (("node-a", True), ("node-b", False)):
        await r.set(keys.node(job, host), encode_node_record(NodeRecord(
            host=host, job=job, hosts_store=store, nnodes_min=1)))
    await r.set(keys.progress(job), encode_progress(Progress(
        job=job, time=time.time(), incarnation=attempt, generation=generation,
        last_step=step)))
    await r.aclose()


async def stage(nc: Any, redis_url: str, prefix: str,
                job: str) -> tuple[Agents, list[Incident]]:
    """Streams, two agents, a job at step 120 of attempt 0, and the incidents to come."""
    await provision(nc.jetstream(), streams(prefix))
    agents = Agents(nc, prefix, job)
    await agents.start()
    await seed(redis_url, prefix, job, attempt=0, step=120)
    return agents, await incidents_of(nc, prefix, job)


def diagnosis(job: str, ident: str, cause: str = "process_crash", host: str = "node-b",
              step: int = 120) -> Diagnosis:
    """A diagnosis as the diagnoser makes it: a crash-type cause from a worker's exit."""
    now = time.time()
    return Diagnosis(id=ident, job=job, anomaly_ids=[f"anomaly-{ident}"], cause=cause,  # type: ignore[arg-type]
                     confidence=0.8, ranks=[3], hosts=[host], step=step, time=now,
                     onset_at=now - 3, summary=f"rank 3 on {host}: {cause}",
                     worker_exited=cause in CRASHING)


async def incidents_of(nc: Any, prefix: str, job: str) -> list[Incident]:
    got: list[Incident] = []

    async def cb(msg: Any) -> None:
        got.append(decode_durable(msg.data, Incident))

    await nc.subscribe(Subjects(prefix).event(job, "incident"), cb=cb)
    return got


def settings_for(nats_url: str, redis_url: str, prefix: str, **kw: Any) -> RemediatorSettings:
    return load_settings(RemediatorSettings, env={}, overrides={
        "nats_url": nats_url, "redis_url": redis_url, "prefix": prefix, "lease_ttl": 1.0, **kw})


@contextlib.asynccontextmanager
async def leading(nats_url: str, redis_url: str, prefix: str, tmp_path: Path | None = None,
                  defaults: str = "") -> AsyncIterator[RemediatorService]:
    """A remediator running and leading: the shipped policy, overlaid by ``defaults`` (lines
    of a ``[defaults]`` section, in a file under ``tmp_path``)."""
    policy = ""
    if tmp_path is not None:
        (tmp_path / "policy.toml").write_text(f"[defaults]\n{defaults}\n")
        policy = str(tmp_path / "policy.toml")
    svc = RemediatorService(settings_for(nats_url, redis_url, prefix, policy=policy))
    async with running(svc):
        await wait_until(lambda: svc.leader is not None and svc.leader.leading, what="leading")
        yield svc


async def test_crash_to_restart_to_resolved(nats_url: str, redis_url: str, prefix: str,
                                            job: str, nc: Any, tmp_path: Path) -> None:
    agents, seen = await stage(nc, redis_url, prefix, job)
    actions: list[Action] = []

    async def on_action(msg: Any) -> None:
        actions.append(decode_durable(msg.data, Action))

    await nc.subscribe(Subjects(prefix).event(job, "action"), cb=on_action)
    # The launcher never restarts here.
    async with leading(nats_url, redis_url, prefix, tmp_path, "launcher_grace_s = 0"):
        bus = Bus(nc, Subjects(prefix), source="test")
        await bus.publish_durable(Subjects(prefix).event(job, "diagnosis"),
                                  diagnosis(job, "d1"))
        await wait_until(lambda: any(i.status == "mitigating" and i.mitigated_at
                                     for i in seen), what="mitigated")
        # Training comes back in a new attempt and passes the failure step.
        await seed(redis_url, prefix, job, attempt=1, step=121)
        await wait_until(lambda: any(i.status == "resolved" for i in seen), what="resolved")
    final = seen[-1]
    assert next(i.status for i in seen) == "open" and final.status == "resolved"
    assert all(getattr(final, f) for f in ("onset_at", "detected_at", "diagnosed_at",
                                           "first_action_at", "mitigated_at", "resolved_at"))
    assert final.failure_step == 120 and final.steps_lost == 120  # no checkpoint: from 0
    assert [a.action for a in final.actions] == ["restart"]
    assert final.actions[0].status == "done"
    assert agents.executed("restart") == {agents.commands[0].id}
    assert len(agents.commands) == 1
    assert agents.commands[0].epoch >= 1 and agents.commands[0].issuer == "remediator"
    assert [a.action for a in actions] == ["restart"] and actions[0].status == "acked"
    assert sorted(i.rev for i in seen) == list(range(1, len(seen) + 1))


async def test_no_second_restart_when_the_launcher_already_restarted(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    agents, seen = await stage(nc, redis_url, prefix, job)
    async with leading(nats_url, redis_url, prefix):
        bus = Bus(nc, Subjects(prefix), source="test")
        await bus.publish_durable(Subjects(prefix).event(job, "diagnosis"), diagnosis(job, "d1"))
        await wait_until(lambda: seen, what="incident open")
        await seed(redis_url, prefix, job, attempt=1, step=121)  # torchrun restarted the group
        await wait_until(lambda: any(i.status == "resolved" for i in seen), timeout=30,
                         what="resolved")
    final = seen[-1]
    assert final.actions[0].action == "restart" and final.actions[0].status == "skipped"
    assert "already restarted" in final.actions[0].detail
    assert agents.commands == []


async def test_a_hang_with_culprits_on_two_hosts_dumps_each_host_s_own_and_restarts(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    """Ranks 1 (node-a) and 3 (node-b) are the hang's culprits: each host is asked for the
    culprits' dumps at once, in one step, and dumps its own (neither refuses for the other's
    rank), and the restart the dumps precede runs."""
    agents, seen = await stage(nc, redis_url, prefix, job)
    async with leading(nats_url, redis_url, prefix):
        bus = Bus(nc, Subjects(prefix), source="test")
        d = diagnosis(job, "d1", cause="rank_hang")
        d.ranks, d.hosts = [1, 3], ["node-a", "node-b"]
        await bus.publish_durable(Subjects(prefix).event(job, "diagnosis"), d)
        await wait_until(lambda: any(i.mitigated_at for i in seen), timeout=30,
                         what="mitigated")
        await seed(redis_url, prefix, job, attempt=1, step=121)
        await wait_until(lambda: any(i.status == "resolved" for i in seen), timeout=30,
                         what="resolved")
    final = seen[-1]
    assert [(a.action, a.status) for a in final.actions] == [
        ("dump", "done"), ("restart", "done")], final.actions
    assert len(final.actions[0].command_ids) == 2  # one command per host
    assert (agents.nodes["node-a"].calls[0], agents.nodes["node-b"].calls[0]) == (
        "dump:[1]", "dump:[3]")


async def test_dumps_on_many_hosts_go_out_at_once_and_silent_hosts_hold_nothing_up(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any,
        tmp_path: Path) -> None:
    """A hang's culprits on five hosts, three of them lost (no agent answers): the five
    dumps go out together and share one ack deadline, so the restart follows after one
    deadline, not two per silent host (the sends once waited for each other's acks)."""
    agents, seen = await stage(nc, redis_url, prefix, job)
    deadline = 3.0
    heard: dict[str, float] = {}

    async def on_command(msg: Any) -> None:
        cmd = decode_durable(msg.data, Command)
        if cmd.kind == "dump":
            heard.setdefault(msg.subject.rsplit(".", 1)[-1], time.monotonic())

    await nc.subscribe(Subjects(prefix).pattern("cmd", job, "host.*"), cb=on_command)
    hosts = ["node-a", "node-b", "node-c", "node-d", "node-e"]
    async with leading(nats_url, redis_url, prefix, tmp_path, f"ack_timeout_s = {deadline}"):
        bus = Bus(nc, Subjects(prefix), source="test")
        d = diagnosis(job, "d1", cause="rank_hang")
        d.ranks, d.hosts = [1, 3, 5, 7, 9], hosts
        await bus.publish_durable(Subjects(prefix).event(job, "diagnosis"), d)
        await wait_until(lambda: any(i.mitigated_at for i in seen), timeout=60,
                         what="mitigated")
        await wait_until(lambda: any(a.action == "restart" and a.status != "pending"
                                     for i in seen for a in i.actions), timeout=60,
                         what="the restart after the dumps")
    dumps = [a for a in seen[-1].actions if a.action == "dump"]
    assert len(dumps) == 1 and len(dumps[0].command_ids) == 5, seen[-1].actions
    assert dumps[0].status == "done", dumps[0]
    calls = (agents.nodes["node-a"].calls[0], agents.nodes["node-b"].calls[0])
    assert calls == ("dump:[1]", "dump:[3]")
    assert sorted(heard) == hosts
    assert max(heard.values()) - min(heard.values()) < deadline, heard  # none waited


async def test_a_sick_host_is_blocklisted_isolated_and_the_rest_restarted(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    agents, seen = await stage(nc, redis_url, prefix, job)
    async with leading(nats_url, redis_url, prefix, tmp_path, "launcher_grace_s = 0"):
        bus = Bus(nc, Subjects(prefix), source="test")
        await bus.publish_durable(Subjects(prefix).event(job, "diagnosis"),
                                  diagnosis(job, "d1", cause="hbm_ecc"))
        await wait_until(lambda: any(i.mitigated_at for i in seen), what="mitigated")
        await seed(redis_url, prefix, job, attempt=1, step=121)
        await wait_until(lambda: any(i.status == "resolved" for i in seen), what="resolved")
    final = seen[-1]
    assert [(a.action, a.status) for a in final.actions] == [("isolate", "done"),
                                                              ("restart", "done")]
    isolate, restart = agents.commands
    assert (isolate.kind, isolate.target, restart.kind, restart.target) == (
        "isolate", "host.node-b", "restart", "all")
    assert final.actions[0].command_ids == [isolate.id]
    r = aioredis.Redis.from_url(redis_url)
    raw = await r.hget(Keys(prefix).blocklist(), "node-b")
    await r.aclose()
    assert raw is not None
    entry = decode_blocklist_entry(raw)
    assert (entry.cause, entry.job, entry.incident) == ("hbm_ecc", job, final.id)
    assert "hbm_ecc" in entry.reason and entry.time > 0


async def test_save_rollback_and_resume_go_through_the_coordinator_endpoints(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    agents, seen = await stage(nc, redis_url, prefix, job)
    s = Subjects(prefix)
    asked: list[SaveRequest] = []

    async def save(msg: Any) -> None:  # a stand-in for the coordinator
        asked.append(SAVE.decode_request(msg.data))
        await msg.respond(SAVE.encode_reply(SaveReply(ok=True, job=job, status="committed",
                                                      step=118)))

    async def resume(msg: Any) -> None:
        RESUME.decode_request(msg.data)
        await msg.respond(encode_durable(ResumePoint(job=job, step=118, path="/ckpt/118")))

    await nc.subscribe(SAVE.subject(s, job), cb=save)
    await nc.subscribe(RESUME.subject(s, job), cb=resume)
    async with leading(nats_url, redis_url, prefix, tmp_path, "save_deadline_s = 7"):
        bus = Bus(nc, s, source="test")
        await bus.publish_durable(s.event(job, "diagnosis"), diagnosis(job, "d1", "gpu_lost"))
        await wait_until(lambda: any(i.mitigated_at for i in seen), what="mitigated")
        await seed(redis_url, prefix, job, attempt=1, step=121)
        await wait_until(lambda: any(i.status == "resolved" for i in seen), what="resolved")
        # Nobody answers a rollback: the step fails and the incident escalates.
        await bus.publish_durable(s.event(job, "diagnosis"), diagnosis(job, "d2", "numeric",
                                                                       host="node-a"))
        await wait_until(lambda: any(i.status == "escalated" for i in seen), what="escalated")
    resolved = next(i for i in seen if i.status == "resolved")
    assert [(a.action, a.status) for a in resolved.actions] == [
        ("save_now", "done"), ("isolate", "done"), ("restart", "done")]
    assert resolved.actions[0].detail == "committed step 118"
    assert [a.deadline for a in asked] == [7.0]
    assert (resolved.resume_step, resolved.steps_lost) == (118, 2)
    escalated = next(i for i in seen if i.status == "escalated")
    assert escalated.actions[0].action == "rollback"
    assert escalated.actions[0].status == "failed"
    assert "no answer from the checkpoint coordinator" in escalated.escalation
    assert len(agents.executed("restart")) == 1  # a failed rollback is not followed by one


async def test_a_fault_beyond_the_restart_budget_holds_the_job(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    await provision(nc.jetstream(), streams(prefix))
    agents = Agents(nc, prefix, job)
    await agents.start()
    await seed(redis_url, prefix, job, attempt=0, step=50)
    seen = await incidents_of(nc, prefix, job)
    async with leading(nats_url, redis_url, prefix, tmp_path,
                       "restart_budget_per_hour = 1\ncooldown_s = 0\nlauncher_grace_s = 0"):
        bus = Bus(nc, Subjects(prefix), source="test")
        await bus.publish_durable(Subjects(prefix).event(job, "diagnosis"), diagnosis(
            job, "d1", step=50))
        await wait_until(lambda: agents.executed("restart"), what="first restart")
        await seed(redis_url, prefix, job, attempt=1, step=60)
        await bus.publish_durable(Subjects(prefix).event(job, "diagnosis"), diagnosis(
            job, "d2", step=60))  # got past the first failure: a new one, not a loop
        await wait_until(lambda: any(i.status == "failed" for i in seen), what="failed")
    failed = next(i for i in seen if i.status == "failed")
    assert [(a.action, a.status) for a in failed.actions] == [("escalate", "done"),
                                                               ("hold", "done")]
    assert "budget" in failed.escalation and "rank 3 on node-b" in failed.escalation
    assert len(agents.executed("restart")) == 1
    assert len(agents.executed("hold")) == 1
    assert all(any(c.startswith("hold:") for c in n.calls) for n in agents.nodes.values())


async def test_leader_dies_mid_incident_and_the_standby_finishes_without_repeats(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    await provision(nc.jetstream(), streams(prefix))
    agents = Agents(nc, prefix, job, drop_first_ack=True)  # the first ack is lost
    await agents.start()
    await seed(redis_url, prefix, job, attempt=0, step=200)
    seen = await incidents_of(nc, prefix, job)
    policy = tmp_path / "policy.toml"
    policy.write_text("[defaults]\nack_timeout_s = 60\nlauncher_grace_s = 0\n")
    env = {**os.environ, "TRAINGUARD_NATS_URL": nats_url, "TRAINGUARD_REDIS_URL": redis_url,
           "TRAINGUARD_PREFIX": prefix, "TRAINGUARD_LEASE_TTL": "1.5",
           "TRAINGUARD_POLICY": str(policy)}
    ports = [free_port(), free_port()]
    procs = [subprocess.Popen([sys.executable, "-m", "trainguard", "service", "remediator",
                               "--health-port", str(p)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for p in ports]
    try:
        async def role(port: int) -> str:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                return "down"
            writer.write(b"GET /readyz HTTP/1.1\r\n\r\n")
            body = (await reader.read()).decode()
            writer.close()
            return "leader" if "(leader)" in body else "standby"

        async def roles() -> list[str]:
            return [await role(p) for p in ports]

        await wait_until(lambda: _sorted_roles(roles(), ["leader", "standby"]), timeout=60,
                         what="one leader, one standby")
        leader = (await roles()).index("leader")
        bus = Bus(nc, Subjects(prefix), source="test")
        await bus.publish_durable(Subjects(prefix).event(job, "diagnosis"), diagnosis(job, "d1"))
        await wait_until(lambda: len(agents.commands) == 1, timeout=30, what="first command")
        procs[leader].send_signal(signal.SIGKILL)  # dies without releasing its lock
        procs[leader].wait(10)
        await wait_until(lambda: len(agents.commands) == 2, timeout=60,
                         what="the standby re-sends as a retry")
        await seed(redis_url, prefix, job, attempt=1, step=201)
        await wait_until(lambda: any(i.status == "resolved" for i in seen), timeout=60,
                         what="resolved by the new leader")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(20)
    first, retry = agents.commands
    assert retry.retry_of == first.id and retry.epoch > first.epoch
    assert agents.executed("restart") == {first.id}  # run once; the retry acked as done


async def _sorted_roles(roles: Any, want: list[str]) -> bool:
    return sorted(await roles) == want


NODE_RESTARTS = {"node-a": 5, "node-b": 0}
"""Each node's own restart count before the job's first attempt here: node-a restarted its
group alone before, so its count is ahead (per-node counts are no job-wide number)."""


def crash_exit(job: str, attempt: int, host: str = "node-b", **kw: Any) -> WorkerExit:
    """An exit of the job's attempt ``attempt``: the group's generation ``20 + attempt``,
    at the host's own restart count for it."""
    return WorkerExit(id=f"exit-{host}-{attempt}-{kw.get('initiated_by')}", job=job,
                      host=host, rank=3, exit_code=1, attempt=NODE_RESTARTS[host] + attempt,
                      generation=20 + attempt, time=time.time(), **kw)


async def exits_handled(nc: Any, prefix: str, seq: int) -> bool:
    """The remediator's exits consumer has handled every report up to stream ``seq``."""
    info = await nc.jetstream().consumer_info(stream_name(prefix, "reports"),
                                              "remediator-exits")
    return bool(info.delivered.stream_seq >= seq and not info.num_ack_pending
                and not info.num_pending)


async def test_a_failure_seen_on_two_hosts_and_restarted_by_the_remediator_counts_once(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    """Generation 20 dies: rank 3's exit on node-b, its peer's failure on node-a (each at
    its node's own restart count), and the remediator's restart of it (the launcher does
    not restart here): one attempt, one entry of the restart budget."""
    agents, seen = await stage(nc, redis_url, prefix, job)
    await seed(redis_url, prefix, job, attempt=0, step=120, generation=20)
    s = Subjects(prefix)
    keys = Keys(prefix)
    r = aioredis.Redis.from_url(redis_url)
    try:
        async with leading(nats_url, redis_url, prefix, tmp_path, "launcher_grace_s = 0"):
            bus = Bus(nc, s, source="test")
            for host in ("node-b", "node-a"):
                ack = await bus.publish_durable(s.exit(job, host), crash_exit(job, 0, host))
            await bus.publish_durable(s.event(job, "diagnosis"), diagnosis(job, "d1"))
            await wait_until(lambda: agents.executed("restart"), what="the restart")
            await wait_until(lambda: any(a.action == "restart" and a.status == "done"
                                         for i in seen for a in i.actions),
                             what="the restart step done (and counted)")
            await wait_until(lambda: exits_handled(nc, prefix, ack.seq),
                             what="both exits counted")
            assert await r.zrange(keys.restarts(job), 0, -1) == [b"generation:20"]
            restarted = next(i for i in seen if i.restarted_attempt is not None)
            assert restarted.failure_generation == 20
    finally:
        await r.aclose()


async def test_a_crash_loop_is_one_incident_held_once_when_torchruns_restarts_pass_the_budget(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    agents, seen = await stage(nc, redis_url, prefix, job)
    s = Subjects(prefix)
    actions: list[Action] = []

    async def on_action(msg: Any) -> None:
        actions.append(decode_durable(msg.data, Action))

    await nc.subscribe(s.event(job, "action"), cb=on_action)
    keys = Keys(prefix)
    r = aioredis.Redis.from_url(redis_url)

    async def crashed(attempt: int, ident: str | None = None, **kw: Any) -> None:
        """Attempt ``attempt`` dies as the ones before: its exit, then (maybe) its diagnosis."""
        await bus.publish_durable(s.exit(job, kw.get("host", "node-b")), crash_exit(
            job, attempt, **kw))
        if ident is not None:
            d = diagnosis(job, ident)
            d.evidence = [EvidenceItem(fact="exited with code 1", source="exit",
                                       value="RuntimeError: bad batch")]
            await bus.publish_durable(s.event(job, "diagnosis"), d)

    async def counted() -> int:
        return int(await r.zcard(keys.restarts(job)))

    try:
        async with leading(nats_url, redis_url, prefix, tmp_path,
                           "restart_budget_per_hour = 2"):
            bus = Bus(nc, s, source="test")
            await crashed(0, "d1")
            await wait_until(lambda: seen, what="incident open")
            await seed(redis_url, prefix, job, attempt=1, step=120)  # torchrun restarted it
            await crashed(1, "d2")
            await crashed(1, host="node-a")  # the peer's view of the same attempt
            await crashed(1, initiated_by="launcher", host="node-a")
            await wait_until(lambda: any("d2" in i.diagnosis_ids for i in seen),
                             what="d2 joined")
            last = await bus.publish_durable(s.exit(job, "node-a"), crash_exit(
                job, 1, host="node-a", initiated_by="cmd-x"))  # counts nothing: a marker
            await wait_until(lambda: exits_handled(nc, prefix, last.seq), what="exits counted")
            assert await counted() == 2 and not any(i.status == "failed" for i in seen)
            await crashed(2)  # the third attempt dies: past the budget of 2 restarts
            await wait_until(lambda: any(i.status == "failed" for i in seen), timeout=30,
                             what="held and failed")
            await crashed(3, "d3")  # it died again before the hold landed: a late diagnosis
            await wait_until(lambda: any("d3" in i.diagnosis_ids for i in seen), what="d3")
    finally:
        await r.aclose()
    final = seen[-1]
    assert {i.id for i in seen} == {final.id}  # one incident for the whole loop
    assert final.status == "failed" and final.diagnosis_ids == ["d1", "d2", "d3"]
    assert [(a.action, a.status) for a in final.actions] == [
        ("restart", "skipped"), ("escalate", "done"), ("hold", "done")]
    pages = [a for a in actions if a.action == "escalate"]
    assert len(pages) == 1  # on-call hears of the loop once
    assert "restart budget spent (3 restarts" in pages[0].detail
    assert "process_crash: rank 3 on node-b: RuntimeError: bad batch" in pages[0].detail
    hold = next(c for c in agents.commands if c.kind == "hold")
    assert (hold.target, hold.issuer) == ("all", "remediator")
    assert agents.executed("hold") == {hold.id} and agents.executed("restart") == set()


async def test_an_incident_whose_launchers_all_exited_fails_with_one_page(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path) -> None:
    agents, seen = await stage(nc, redis_url, prefix, job)
    s = Subjects(prefix)
    async with leading(nats_url, redis_url, prefix, tmp_path, "launcher_grace_s = 3"):
        bus = Bus(nc, s, source="test")
        await bus.publish_durable(s.event(job, "diagnosis"), diagnosis(job, "d1"))
        await wait_until(lambda: seen, what="incident open")
        for host in ("node-a", "node-b"):  # torchrun gave up: each launcher says it left
            await bus.publish_durable(s.reg_node(job, host), NodeHello(
                job=job, host=host, time=time.time(), left=True))
        await wait_until(lambda: any(i.status == "failed" for i in seen), timeout=30,
                         what="failed")
    final = seen[-1]
    assert [(a.action, a.status) for a in final.actions] == [
        ("restart", "skipped"), ("escalate", "done"), ("hold", "skipped")]
    assert "every launcher of the job has exited" in final.escalation
    assert "rank 3 on node-b" in final.escalation
    assert agents.commands == []  # nobody left to tell


async def test_node_records_follow_the_agents_hellos(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    """Agents never write Redis: a node hello creates the host's record, a ``left`` hello
    takes it out of the job, and an older hello delivered after it does not bring it back."""
    await provision(nc.jetstream(), streams(prefix))
    s, keys = Subjects(prefix), Keys(prefix)
    bus = Bus(nc, s, source="test-agent")
    r = aioredis.Redis.from_url(redis_url)

    async def record() -> NodeRecord | None:
        raw = await r.get(keys.node(job, "node-a"))
        return decode_node_record(raw) if raw else None

    def node_hello(at: float, **kw: Any) -> NodeHello:
        return NodeHello(job=job, host="node-a", local_ranks=[0, 1], hosts_store=True,
                         time=at, **kw)

    async def hosts(svc: RemediatorService) -> set[str]:
        return set((await svc.store.view(job, "process_crash")).hosts)

    started = time.time()
    try:
        # The hello is in the stream before any remediator runs: the durable replays it.
        await bus.publish_durable(s.reg_node(job, "node-a"), node_hello(started))
        await bus.publish_durable(s.reg_rank(job, 0), RankHello(
            job=job, rank=0, world_size=2, host="node-a", time=started))  # not a node's
        async with leading(nats_url, redis_url, prefix) as svc:
            await wait_until(record, what="the node record")
            got = await record()
            assert got is not None and got.local_ranks == [0, 1] and got.hosts_store
            assert await hosts(svc) == {"node-a"}
            await bus.publish_durable(s.reg_node(job, "node-a"),
                                      node_hello(started + 5, left=True))

            async def gone() -> bool:
                return not await hosts(svc)

            await wait_until(gone, what="the host out of the job")
            await bus.publish_durable(s.reg_node(job, "node-a"), node_hello(started + 1))

            async def settled() -> bool:
                info = await nc.jetstream().consumer_info(stream_name(prefix, "reports"),
                                                          "remediator-nodes")
                return bool(info.delivered.stream_seq >= 4 and not info.num_ack_pending
                            and not info.num_pending)

            await wait_until(settled, what="the stale hello handled")
            assert not await hosts(svc)  # it did not undo the left
            got = await record()
            assert got is not None and got.left and got.time == started + 5
            assert await r.pttl(keys.node(job, "node-a")) > 0  # a tombstone, expiring
    finally:
        await r.aclose()
