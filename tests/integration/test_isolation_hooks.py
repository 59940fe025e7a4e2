"""Isolation reaches the scheduler, on real NATS and Redis: the remediator runs the shipped
Kubernetes and Slurm hooks for real (kubectl and scontrol are stand-ins that record their
calls), a blocklist entry ends by its TTL or by ``trainguard unblock``, and the host is
then given back (the release hook)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.conftest import wait_until
from tests.integration.recorder import running
from tests.integration.test_remediator_service import diagnosis, seed, settings_for, stage
from tests.unit.test_remediator_hooks import HOOKS, calls, fake_tools
from trainguard.contract.schemas import Incident, NodeHello
from trainguard.contract.subjects import Subjects
from trainguard.runtime.bus import Bus
from trainguard.runtime.state import Keys, read_blocklist_entry
from trainguard.services.remediator.service import RemediatorService


@contextlib.asynccontextmanager
async def remediator(nats_url: str, redis_url: str, prefix: str,
                     **kw: Any) -> AsyncIterator[RemediatorService]:
    svc = RemediatorService(settings_for(nats_url, redis_url, prefix, **kw))
    async with running(svc):
        await wait_until(lambda: svc.leader is not None and svc.leader.leading, what="leading")
        yield svc


async def entry_of(redis_url: str, prefix: str, host: str) -> Any:
    r = aioredis.Redis.from_url(redis_url)
    try:
        raw = await r.hget(Keys(prefix).blocklist(), host)
    finally:
        await r.aclose()
    return read_blocklist_entry(raw) if raw is not None else None


async def isolate_node_b(nc: Any, redis_url: str, prefix: str, job: str,
                         seen: list[Incident]) -> Incident:
    """An hbm_ecc diagnosis on node-b: the incident isolates it and restarts the rest."""
    await Bus(nc, Subjects(prefix), source="test").publish_durable(
        Subjects(prefix).event(job, "diagnosis"), diagnosis(job, "d1", cause="hbm_ecc"))
    await wait_until(lambda: any(i.mitigated_at for i in seen), timeout=60, what="mitigated")
    await seed(redis_url, prefix, job, attempt=1, step=121)
    await wait_until(lambda: any(i.status == "resolved" for i in seen), timeout=60,
                     what="resolved")
    return seen[-1]


def uses(tools: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The remediator's hooks inherit its environment: the stand-ins come first on PATH."""
    for name, value in tools.items():
        monkeypatch.setenv(name, value)


async def test_kubernetes_hooks_cordon_the_node_and_give_it_back_when_the_ttl_ends(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "kubectl.jsonl"
    uses(fake_tools(tmp_path / "bin", record, "kubectl"), monkeypatch)
    monkeypatch.setenv("FAKE_NODES", "node-a,node-b")
    ttl = 3.0
    agents, seen = await stage(nc, redis_url, prefix, job)
    async with remediator(nats_url, redis_url, prefix, blocklist_ttl=ttl, blocklist_sweep=0.2,
                          isolate_hook=f"{HOOKS}/k8s-isolate.sh {{host}} {{reason}}",
                          release_hook=f"{HOOKS}/k8s-release.sh {{host}}"):
        final = await isolate_node_b(nc, redis_url, prefix, job, seen)
        await wait_until(lambda: any(c["argv"][0] == "uncordon" for c in calls(record)),
                         timeout=60, what="the node given back")
        await wait_until(lambda: _gone(redis_url, prefix, "node-b"), timeout=30,
                         what="the entry removed")
    isolate, restart = final.actions
    assert (isolate.action, isolate.status, restart.action, restart.status) == (
        "isolate", "done", "restart", "done")
    assert isolate.hook is not None and isolate.hook.status == "ok", isolate.hook
    assert isolate.hook.argv[1:] == ["node-b", "rank 3 on node-b: hbm_ecc"]
    assert "hook ok" in isolate.detail
    argvs = [c["argv"] for c in calls(record)]
    assert ["cordon", "node-b"] in argvs and ["uncordon", "node-b"] in argvs
    assert ["annotate", "nodes", "node-b", "trainguard.io/isolated-reason=rank 3 on node-b: "
            "hbm_ecc", "--overwrite"] in argvs
    assert not any("node-a" in a for a in argvs)
    # Not given back before its time: the entry was written after the step started.
    cordoned = next(c["time"] for c in calls(record) if c["argv"][0] == "cordon")
    released = next(c["time"] for c in calls(record) if c["argv"][0] == "uncordon")
    assert isolate.at is not None and released >= isolate.at + ttl
    assert released > cordoned
    assert agents.executed("isolate")  # the agent was told as well


async def _gone(redis_url: str, prefix: str, host: str) -> bool:
    return await entry_of(redis_url, prefix, host) is None


async def test_unblock_ends_an_entry_at_once_and_the_remediator_resumes_the_slurm_node(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "scontrol.jsonl"
    uses(fake_tools(tmp_path / "bin", record, "scontrol"), monkeypatch)
    agents, seen = await stage(nc, redis_url, prefix, job)
    async with remediator(nats_url, redis_url, prefix, blocklist_ttl=0, blocklist_sweep=0.2,
                          isolate_hook=f"{HOOKS}/slurm-isolate.sh {{host}} {{reason}}",
                          release_hook=f"{HOOKS}/slurm-release.sh {{host}}") as svc:
        final = await isolate_node_b(nc, redis_url, prefix, job, seen)
        entry = await entry_of(redis_url, prefix, "node-b")
        assert entry is not None and entry.expires == 0  # ttl 0: until unblocked
        assert "node-b" not in (await svc.store.view(job, "hbm_ecc")).hosts
        assert [c["argv"] for c in calls(record)] == [
            ["update", "NodeName=node-b", "State=DRAIN",
             "Reason=trainguard: rank 3 on node-b: hbm_ecc"]]

        code, out = await unblock(nats_url, redis_url, prefix, "node-b", "--note", "reseated")
        assert code == 0, out
        assert "node-b may join jobs again" in out
        ended = await entry_of(redis_url, prefix, "node-b")
        # Ended at once for every reader, before any sweep: the job may take it back.
        assert ended is None or (not ended.active(time.time())
                                 and "reseated" in ended.released_by)
        await wait_until(lambda: len(calls(record)) == 2, timeout=30, what="node resumed")
        await wait_until(lambda: _gone(redis_url, prefix, "node-b"), timeout=30,
                         what="the entry removed")
        assert "node-b" in (await svc.store.view(job, "hbm_ecc")).hosts
        code, out = await unblock(nats_url, redis_url, prefix, "node-b")
        assert code == 1 and "not on the blocklist" in out
    assert calls(record)[1]["argv"] == ["update", "NodeName=node-b", "State=RESUME"]
    assert final.actions[0].hook is not None and final.actions[0].hook.status == "ok"
    assert len(agents.executed("isolate")) == 1


async def test_a_failing_hook_is_on_the_incident_and_recovery_goes_on(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "kubectl.jsonl"
    uses(fake_tools(tmp_path / "bin", record, "kubectl"), monkeypatch)
    monkeypatch.setenv("FAKE_NODES", "some-other-node")  # node-b is no Kubernetes node
    _agents, seen = await stage(nc, redis_url, prefix, job)
    async with remediator(nats_url, redis_url, prefix,
                          isolate_hook=f"{HOOKS}/k8s-isolate.sh {{host}} {{reason}}"):
        final = await isolate_node_b(nc, redis_url, prefix, job, seen)
        entry = await entry_of(redis_url, prefix, "node-b")
    isolate, restart = final.actions
    assert isolate.hook is not None
    assert (isolate.hook.status, isolate.hook.exit_code) == ("failed", 3)
    assert "no node is named node-b" in isolate.hook.output
    assert "hook failed exit 3" in isolate.detail
    assert (isolate.status, restart.status) == ("done", "done")  # the job still recovered
    assert entry is not None and entry.active(entry.time) and entry.expires > entry.time
    assert [c["argv"][0] for c in calls(record)] == ["get"]


def test_a_bad_hook_template_stops_the_remediator_at_start(nats_url: str, redis_url: str,
                                                           prefix: str) -> None:
    from trainguard.contract.errors import ConfigError

    with pytest.raises(ConfigError, match=r"isolate_hook.*\{node\}"):
        RemediatorService(settings_for(nats_url, redis_url, prefix,
                                       isolate_hook="kubectl cordon {node}"))


async def unblock(nats_url: str, redis_url: str, prefix: str, host: str,
                  *extra: str) -> tuple[int, str]:
    """``trainguard unblock`` as an operator runs it: the real command, in a process."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trainguard", "unblock", host, "--nats", nats_url, "--redis",
        redis_url, "--prefix", prefix, *extra, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, "TRAINGUARD_CREDENTIALS": ""})
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return int(proc.returncode or 0), out.decode()


async def test_the_agent_joins_once_its_entry_ended_and_not_before(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    """The agent's launch check (``AgentLink.blocklisted``) against real Redis: an entry in
    force blocks, one past its ``expires`` (TTL or ``trainguard unblock``) does not, even
    before the remediator swept it."""
    from trainguard.agent.link import AgentLink
    from trainguard.agent.node import LocalNode
    from trainguard.agent.settings import AgentSettings
    from trainguard.runtime.config import load_settings
    from trainguard.runtime.state import BlocklistEntry, encode_blocklist_entry
    from trainguard.runtime.topology import provision, streams

    await provision(nc.jetstream(), streams(prefix))
    settings = load_settings(AgentSettings, env={}, overrides={
        "nats_url": nats_url, "redis_url": redis_url, "prefix": prefix, "job": job,
        "host": "node-b", "node_interval": 0.5, "gpu_interval": 60.0})
    node = LocalNode(settings, hosts_store=False, gpu=None, publish_exit=lambda _: None)
    link = AgentLink(settings, node, NodeHello(job=job, host="node-b"))
    r = aioredis.Redis.from_url(redis_url)
    key, now = Keys(prefix).blocklist(), time.time()
    link.start()
    try:
        assert await asyncio.to_thread(link.ready.wait, 60), "agent link not ready"
        assert await asyncio.to_thread(link.blocklisted) is None
        for entry, blocked in (
                (BlocklistEntry(reason="ecc", time=now, expires=now + 3600), True),
                (BlocklistEntry(reason="by hand"), True),  # no expires: until unblocked
                (BlocklistEntry(reason="ecc", time=now - 90, expires=now - 30), False),
                (BlocklistEntry(reason="ecc", expires=now - 1, released_by="unblock"), False)):
            await r.hset(key, "node-b", encode_blocklist_entry(entry))
            reason = await asyncio.to_thread(link.blocklisted)
            assert (reason == entry.reason) if blocked else reason is None, entry
    finally:
        await asyncio.to_thread(link.close, 10.0)
        await r.delete(key)
        await r.aclose()
