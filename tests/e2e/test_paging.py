"""A chaos drill pages on-call: the demo's cluster (``trainguard up`` with the bridge,
two agents, a real 4-rank gloo job) plays the ``kill`` drill; the incident reaches Debian's
Alertmanager (its own notifications say firing, then resolved) and the CloudEvents webhook
receiver, and the delay from each incident event to the receiver is printed.

One cluster per module: the first test (which pays for starting it) checks that a healthy
job pages nobody; the drill gets a test, and a timeout, of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pytest
import pytest_asyncio

from tests.alerting import Alertmanager, Receiver
from tests.conftest import wait_until
from trainguard.contract.codec import decode_durable
from trainguard.contract.envnames import setting
from trainguard.contract.schemas import Incident
from trainguard.contract.subjects import Subjects
from trainguard.demo.cluster import Cluster
from trainguard.demo.runner import Runner
from trainguard.demo.scenario import FAULTS

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Paging:
    cluster: Cluster
    receiver: Receiver
    am: Alertmanager
    published: dict[tuple[str, int], float] = field(default_factory=dict)
    """(incident, rev) → when the remediator published it (``ce-time``)."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def paging(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Paging]:
    tmp = tmp_path_factory.mktemp("paging")
    receiver = Receiver().start()
    (tmp / "am").mkdir()
    am = Alertmanager(tmp / "am", receiver.url).start()
    cluster = Cluster(tmp / "cluster", "paging", steps=1_000_000, step_time=0.05,
                      ckpt_every=10, plane_env={setting("alertmanager_url"): am.url,
                                                setting("webhook_url"): f"{receiver.url}/ce"})
    p = Paging(cluster, receiver, am)
    try:
        await cluster.start()

        async def on_incident(msg: Any) -> None:
            inc = decode_durable(msg.data, Incident)
            p.published[(inc.id, inc.rev)] = datetime.fromisoformat(
                msg.headers["ce-time"]).timestamp()

        await cluster.nc.subscribe(Subjects(cluster.prefix).event(cluster.job, "incident"),
                                   cb=on_incident)
        yield p
    finally:
        await cluster.stop()
        am.stop()
        receiver.stop()


def am_says(receiver: Receiver, incident: str, status: str) -> bool:
    return any(r.json()["status"] == status
               and any(a["labels"].get("incident") == incident for a in r.json()["alerts"])
               for r in receiver.at("/am"))


async def test_a_healthy_job_pages_nobody(paging: Paging) -> None:
    log = (paging.cluster.workdir / "control-plane.log").read_text()
    assert "bridge: ready" in log
    start = paging.cluster.observer.max_step
    await wait_until(lambda: paging.cluster.observer.max_step >= start + 40, timeout=90,
                     what="40 clean steps")
    assert paging.receiver.got == [] and await asyncio.to_thread(paging.am.alerts) == []


async def test_a_drill_incident_pages_and_resolves(paging: Paging) -> None:
    cluster, receiver = paging.cluster, paging.receiver
    out = await Runner(cluster).play(FAULTS["kill"])
    assert out.ok, (out.problems, cluster.observer.timeline[-25:])
    inc = next(i for i in cluster.observer.incidents.values() if i.status == "resolved")
    await wait_until(lambda: am_says(receiver, inc.id, "firing"), timeout=30,
                     what="Alertmanager to notify the firing alert")
    await wait_until(lambda: am_says(receiver, inc.id, "resolved"), timeout=30,
                     what="Alertmanager to notify the resolve")
    hooks = await wait_until(lambda: [h for h in receiver.at("/ce")
                                      if h.headers["ce-subject"].endswith(inc.id)]
                             if len(receiver.at("/ce")) >= 2 else None, timeout=30,
                             what="webhook: firing and resolved")
    assert [h.headers["ce-tgstate"] for h in hooks] == ["firing", "resolved"]
    assert not [a for a in await asyncio.to_thread(paging.am.alerts)
                if a["labels"].get("incident") == inc.id]
    delays = [h.at - paging.published[(inc.id, int(h.headers["ce-id"].rsplit(".", 1)[1]))]
              for h in hooks]
    print(f"\n{FAULTS['kill'].name} drill, incident {inc.cause}: event -> webhook "
          + ", ".join(f"{d * 1000:.0f} ms" for d in delays))
