"""The service base against real nats-server and redis-server: settling, dead letters,
health, and recovery from NATS and Redis outages."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import sys
from typing import Any

import nats
import pytest
import redis.asyncio as aioredis

from tests.conftest import wait_until
from tests.integration.recorder import Recorder, recorder_settings, running
from trainguard.contract.codec import decode_as, decode_durable, encode_durable
from trainguard.contract.envelope import normalize_headers
from trainguard.contract.errors import MessageTooLarge, NotStarted
from trainguard.contract.schemas import Anomaly, CommandAck, DeadLetter, Diagnosis
from trainguard.contract.subjects import Subjects
from trainguard.core.connection import flush
from trainguard.runtime.bus import Bus
from trainguard.runtime.embedded import NatsServer, RedisServer
from trainguard.runtime.service import Delivery, Runtime
from trainguard.runtime.topology import provision, stream_name, streams


def anomaly(job: str, ident: str) -> Anomaly:
    return Anomaly(id=ident, job=job, kind="hang", ranks=[1], onset_at=1.0, detected_at=2.0)


async def collect_dead(nc: Any, prefix: str, job: str) -> list[DeadLetter]:
    letters: list[DeadLetter] = []

    async def cb(msg: Any) -> None:
        letters.append(decode_durable(msg.data, DeadLetter))

    await nc.subscribe(Subjects(prefix).dead(job), cb=cb)
    await flush(nc)
    return letters


async def recorded(redis_url: str, key: str) -> set[str]:
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return set(await r.smembers(key))
    finally:
        await r.aclose()


async def test_handled_messages_are_acked_once(nats_url: str, redis_url: str, prefix: str,
                                               job: str, nc: Any) -> None:
    svc = Recorder(recorder_settings(nats_url, redis_url, prefix))
    async with running(svc) as rt:
        bus = Bus(nc, Subjects(prefix), source="test")
        for i in range(20):
            await bus.publish_durable(Subjects(prefix).event(job, "anomaly"), anomaly(job, f"a{i}"))
        await wait_until(lambda: recorded(redis_url, svc.key), what="records")
        await wait_until(lambda: len(svc.attempts) == 20, what="20 anomalies handled")
        assert all(n == 1 for n in svc.attempts.values())
        assert await recorded(redis_url, svc.key) == {f"a{i}" for i in range(20)}
        assert rt.metrics.messages.labels("recorder", "recorder", "ack")._value.get() == 20


async def test_the_runtime_is_a_clear_error_before_start_and_the_services_after(
        nats_url: str, redis_url: str, prefix: str) -> None:
    svc = Recorder(recorder_settings(nats_url, redis_url, prefix))
    with pytest.raises(NotStarted, match=r"^recorder used before start$"):
        _ = svc.runtime
    with pytest.raises(NotStarted, match=r"^the bus of recorder used before start$"):
        _ = Runtime(svc, svc.settings).bus
    async with running(svc) as rt:
        assert svc.runtime is rt and rt.bus.connected


async def test_failing_handler_is_retried_then_dead_lettered_and_service_goes_on(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    svc = Recorder(recorder_settings(nats_url, redis_url, prefix),
                   fail_times={"flaky": 2})
    dead = await collect_dead(nc, prefix, job)
    async with running(svc) as rt:
        bus = Bus(nc, Subjects(prefix), source="test")
        subject = Subjects(prefix).event(job, "anomaly")
        for ident in ("flaky", "poison-1", "reject-1", "after"):
            await bus.publish_durable(subject, anomaly(job, ident))
        await wait_until(lambda: len(dead) >= 2, timeout=30, what="two dead letters")
        await wait_until(lambda: recorded(redis_url, svc.key), what="records")
        by_id = {decode_durable(d.payload, Anomaly).id: d for d in dead}
        assert set(by_id) == {"poison-1", "reject-1"}
        assert "handler failed 3 times" in by_id["poison-1"].reason
        assert "cannot record poison-1" in by_id["poison-1"].reason
        assert by_id["poison-1"].deliveries == 3 and svc.attempts["poison-1"] == 3
        assert "refuses" in by_id["reject-1"].reason and svc.attempts["reject-1"] == 1
        assert by_id["poison-1"].subject == subject
        assert by_id["poison-1"].headers["ce-type"] == "io.trainguard.anomaly.v1"

        def logged() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.getMessage().startswith("dead-lettered")]

        await wait_until(lambda: len(logged()) >= 2, what="dead letters logged")
        assert {getattr(r, "job", None) for r in logged()} == {job}  # the stable key
        await wait_until(lambda: len(svc.attempts) == 4 and svc.attempts["flaky"] == 3,
                         what="flaky recorded on its third delivery")
        assert await recorded(redis_url, svc.key) == {"flaky", "after"}
        assert rt.metrics.dead.labels("recorder", "handler_failed")._value.get() == 1


async def test_wrong_credentials_and_an_outage_that_lasts_end_in_dead_letters(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    """An authentication error is no outage: it fails ``max_deliver`` times and is
    dead-lettered; a transient error is redelivered until the message is
    ``transient_max_s`` old, then dead-lettered (kept for a replay), never retried for good."""
    svc = Recorder(recorder_settings(nats_url, redis_url, prefix, transient_max_s=1.0))
    dead = await collect_dead(nc, prefix, job)
    async with running(svc) as rt:
        bus = Bus(nc, Subjects(prefix), source="test")
        subject = Subjects(prefix).event(job, "anomaly")
        for ident in ("badauth-1", "away-1"):
            await bus.publish_durable(subject, anomaly(job, ident))
        await wait_until(lambda: len(dead) >= 2, timeout=60, what="two dead letters")
        by_id = {decode_durable(d.payload, Anomaly).id: d for d in dead}
        assert "handler failed 3 times" in by_id["badauth-1"].reason
        assert "AuthenticationError" in by_id["badauth-1"].reason
        assert svc.attempts["badauth-1"] == 3
        assert "transient failures for" in by_id["away-1"].reason
        assert "ConnectionError" in by_id["away-1"].reason and svc.attempts["away-1"] >= 2
        assert rt.metrics.dead.labels("recorder", "transient_expired")._value.get() == 1


async def test_malformed_and_wrong_type_go_to_dead_letters_at_once(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    svc = Recorder(recorder_settings(nats_url, redis_url, prefix))
    dead = await collect_dead(nc, prefix, job)
    async with running(svc):
        js = nc.jetstream()
        subject = Subjects(prefix).event(job, "anomaly")
        await js.publish(subject, b"{not json", headers={"ce-type": "io.trainguard.anomaly.v1"})
        await js.publish(subject, b"{}", headers={"ce-type": "io.trainguard.anomaly.v7"})
        bus = Bus(nc, Subjects(prefix), source="test")
        await bus.publish_durable(subject, CommandAck(command_id="c", job=job, responder="x",
                                                      outcome="done"))
        await bus.publish_durable(subject, anomaly(job, "good"))
        await wait_until(lambda: len(dead) >= 3, what="three dead letters")
        reasons = sorted(d.reason for d in dead)
        assert any("malformed anomaly (not JSON)" in r for r in reasons), reasons
        assert any("unknown message type or version 'io.trainguard.anomaly.v7'" in r
                   for r in reasons), reasons
        assert any("CommandAck is not accepted" in r for r in reasons), reasons
        assert all(d.deliveries == 1 for d in dead)
        assert dead[0].payload in (b"{not json", b"{}") or dead[1].payload == b"{not json"
        await wait_until(lambda: svc.attempts.get("good") == 1, what="good message handled")


async def http_get(rt: Runtime, path: str) -> tuple[int, str]:
    """GET ``path`` from the service's health server: status and body."""
    assert rt.health is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", rt.health.port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = (await reader.read()).decode()
    writer.close()
    return int(data.split()[1]), data.split("\r\n\r\n", 1)[1]


async def test_health_endpoints(nats_url: str, redis_url: str, prefix: str) -> None:
    svc = Recorder(recorder_settings(nats_url, redis_url, prefix))
    async with running(svc) as rt:
        async def get(path: str) -> tuple[int, str]:
            return await http_get(rt, path)

        assert (await get("/livez"))[0] == 200
        async def ready() -> bool:
            return (await rt.ready())[0]

        await wait_until(ready, what="ready")
        code, body = await get("/readyz")
        assert code == 200 and "ready" in body
        code, body = await get("/readyz?verbose")
        assert code == 200
        assert body.splitlines() == ["[+] nats: connected", "[+] consumers: bound: recorder",
                                     "[+] redis: answers", "[+] recorder: ready",
                                     "readyz check passed"]
        code, body = await get("/metrics")
        assert code == 200 and "trainguard_handler_seconds" in body
        assert 'trainguard_build_info{' in body and "process_resident_memory_bytes" in body
        assert (await get("/nope"))[0] == 404


class WarmingUp(Recorder):
    async def ready(self) -> tuple[bool, str]:
        return False, "warming up"


async def test_readyz_verbose_names_the_failing_check(nats_url: str, redis_url: str,
                                                      prefix: str) -> None:
    """Regression: ``/readyz?verbose`` was a 404."""
    async with running(WarmingUp(recorder_settings(nats_url, redis_url, prefix))) as rt:
        async def bound() -> bool:
            return all(c.ok for c in await rt.checks() if c.name != "recorder")

        await wait_until(bound, what="everything but the service's own check")
        code, body = await http_get(rt, "/readyz")
        assert (code, body) == (503, "warming up\n")
        code, body = await http_get(rt, "/readyz?verbose")
        assert code == 503
        assert body.splitlines()[-2:] == ["[-] recorder: warming up", "readyz check failed"]
        assert body.startswith("[+] nats: connected\n")


async def test_service_survives_a_nats_server_restart(private_nats: NatsServer, redis_url: str,
                                                      prefix: str, job: str) -> None:
    svc = Recorder(recorder_settings(private_nats.url, redis_url, prefix))
    subject = Subjects(prefix).event(job, "anomaly")
    async with running(svc) as rt:
        pub = await nats.connect(private_nats.url, max_reconnect_attempts=-1,
                                 reconnect_time_wait=0.2)
        bus = Bus(pub, Subjects(prefix), source="test")
        for i in range(5):
            await bus.publish_durable(subject, anomaly(job, f"before-{i}"))
        await wait_until(lambda: len(svc.attempts) == 5, what="first batch")
        private_nats.kill()
        await wait_until(lambda: not rt.bus.connected, what="service sees the outage")
        private_nats.start()
        await wait_until(lambda: rt.bus.connected and pub.is_connected, timeout=30,
                         what="reconnect")
        for i in range(5):
            await bus.publish_durable(subject, anomaly(job, f"after-{i}"))
        await wait_until(lambda: len(svc.attempts) == 10, timeout=30, what="second batch")
        async def ready() -> bool:
            return (await rt.ready())[0]

        await wait_until(ready, timeout=30, what="ready again")
        await pub.close()
    assert await recorded(redis_url, svc.key) == {f"{w}-{i}" for w in ("before", "after")
                                                  for i in range(5)}


async def test_redis_outage_delays_but_loses_no_acknowledged_event(
        nats_url: str, private_redis: RedisServer, prefix: str, job: str, nc: Any) -> None:
    svc = Recorder(recorder_settings(nats_url, private_redis.url, prefix))
    subject = Subjects(prefix).event(job, "anomaly")
    dead = await collect_dead(nc, prefix, job)
    async with running(svc) as rt:
        bus = Bus(nc, Subjects(prefix), source="test")
        await bus.publish_durable(subject, anomaly(job, "e-0"))
        await wait_until(lambda: recorded(private_redis.url, svc.key), what="first record")
        private_redis.stop()
        acked = []
        for i in range(1, 6):
            acked.append(await bus.publish_durable(subject, anomaly(job, f"e-{i}")))
        transient = rt.metrics.messages.labels("recorder", "recorder", "transient")
        await wait_until(lambda: transient._value.get() >= 1, timeout=60,
                         what="a handler to hit the outage")
        private_redis.start()
        want = {f"e-{i}" for i in range(6)}
        await wait_until(lambda: _has_all(private_redis.url, svc.key, want), timeout=60,
                         what="every event recorded after Redis returned")
    assert all(a.seq for a in acked)
    assert dead == []


async def _has_all(url: str, key: str, want: set[str]) -> bool:
    try:
        return want <= await recorded(url, key)
    except Exception:
        return False


async def test_sigterm_drains_and_exits_zero(nats_url: str, redis_url: str, prefix: str,
                                             tmp_path: Any) -> None:
    env = {**os.environ, "TRAINGUARD_NATS_URL": nats_url, "TRAINGUARD_REDIS_URL": redis_url,
           "TRAINGUARD_PREFIX": prefix}
    script = ("import asyncio; from tests.integration.recorder import Recorder; "
              "from trainguard.runtime.config import load_settings, Settings; "
              "from trainguard.runtime.service import run_service; "
              "asyncio.run(run_service(Recorder(load_settings(Settings), "
              "), started=lambda rt: print('READY', flush=True)))")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, env=env, stdout=asyncio.subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert line.strip() == b"READY"
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 20) == 0




# -- no poison pill: one message, whatever it does, stops nothing ----------------------

MIB = 1024 * 1024


def errors(rt: Runtime, consumer: str, reason: str) -> float:
    """``trainguard_message_errors`` of ``consumer`` for ``reason`` so far."""
    value = rt.metrics.registry.get_sample_value(
        "trainguard_message_errors_total",
        {"service": rt.service.name, "consumer": consumer, "reason": reason})
    return value or 0.0


def big_diagnosis(job: str, body_bytes: int) -> Diagnosis:
    """A diagnosis whose JSON body is ``body_bytes`` long (its summary pads it)."""
    d = Diagnosis(id="d-big", job=job, anomaly_ids=["a"], cause="unknown", confidence=0.1)
    d.summary = "x" * (body_bytes - len(encode_durable(d)))
    assert len(encode_durable(d)) == body_bytes
    return d


async def test_a_publish_the_server_would_not_take_is_refused_and_the_connection_stays(
        prefix: str, job: str, nc: Any) -> None:
    s = Subjects(prefix)
    await provision(nc.jetstream(), streams(prefix))
    bus = Bus(nc, s, source="test")
    assert bus.max_payload == nc.max_payload == MIB  # the server's INFO
    subject = s.event(job, "diagnosis")
    # Under the body limit, but not with its headers: sent, the server would drop the link.
    with pytest.raises(MessageTooLarge, match=r"^oversized diagnosis on \S+event.diagnosis "
                                              r"\(body and headers\): \d+ bytes exceeds the "
                                              r"1048576-byte limit$"):
        await bus.publish_durable(subject, big_diagnosis(job, MIB - 50))
    with pytest.raises(MessageTooLarge, match=r"1048586 bytes exceeds the 1048576-byte limit"):
        await bus.publish_durable(subject, big_diagnosis(job, MIB + 10))
    assert nc.is_connected
    assert (await bus.publish_durable(subject, big_diagnosis(job, MIB - 2048))).seq


class Publisher(Recorder):
    """Publishes a diagnosis per anomaly before recording it: ``huge-*`` ones too large."""

    async def handle(self, anomaly: Anomaly, delivery: Delivery) -> None:
        assert self.rt is not None
        if anomaly.id.startswith("huge"):
            self.attempts[anomaly.id] = self.attempts.get(anomaly.id, 0) + 1
            await self.rt.publish_event(self.settings.subjects.event(anomaly.job, "diagnosis"),
                                        big_diagnosis(anomaly.job, 2 * MIB))
        await super().handle(anomaly, delivery)


async def test_a_handler_whose_publish_is_too_large_is_dead_lettered_at_once(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    svc = Publisher(recorder_settings(nats_url, redis_url, prefix))
    dead = await collect_dead(nc, prefix, job)
    async with running(svc) as rt:
        bus = Bus(nc, Subjects(prefix), source="test")
        subject = Subjects(prefix).event(job, "anomaly")
        for ident in ("huge-1", "after"):
            await bus.publish_durable(subject, anomaly(job, ident))
        await wait_until(lambda: dead and svc.attempts.get("after") == 1,
                         what="the letter, then the next message handled")
        assert svc.attempts["huge-1"] == 1  # no retries: it would never fit
        assert dead[0].reason.startswith("the handler's publish was refused: oversized "
                                         "diagnosis on ")
        assert dead[0].consumer == "recorder" and not dead[0].truncated
        assert errors(rt, "recorder", "publish_too_large") == 1
        assert rt.live() is None


async def test_a_dead_letter_that_cannot_be_sent_ends_in_a_term_and_the_consumer_goes_on(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    svc = Recorder(recorder_settings(nats_url, redis_url, prefix))
    async with running(svc) as rt:
        js = nc.jetstream()
        await js.delete_stream(stream_name(prefix, "dead"))  # letters now have nowhere to go
        subject = Subjects(prefix).event(job, "anomaly")
        await js.publish(subject, b"{not json", headers={"ce-type": "io.trainguard.anomaly.v1"})
        await Bus(nc, Subjects(prefix), source="test").publish_durable(subject,
                                                                       anomaly(job, "after"))
        term = rt.metrics.messages.labels("recorder", "recorder", "term")
        await wait_until(lambda: term._value.get() == 1 and svc.attempts.get("after") == 1,
                         what="the poison terminated and the next message handled")
        # Redelivered while the failure might pass, then given up after max_deliver (3).
        assert errors(rt, "recorder", "dead_letter_failed") == 3
        assert errors(rt, "recorder", "malformed") == 3
        assert rt.live() is None and (await http_get(rt, "/livez"))[0] == 200


async def test_core_callbacks_are_isolated_per_message(
        nats_url: str, redis_url: str, prefix: str, job: str, nc: Any) -> None:
    svc = Recorder(recorder_settings(nats_url, redis_url, prefix))
    dead = await collect_dead(nc, prefix, job)
    seen: list[CommandAck] = []

    async def on_ack(msg: Any) -> None:
        if msg.data == b"boom":
            raise RuntimeError("boom")
        seen.append(decode_as(msg.data, normalize_headers(msg.headers).get("ce-type"),
                              CommandAck))

    s = Subjects(prefix)
    async with running(svc) as rt:
        await rt.subscribe(s.ack(job, "recorder"), on_ack, consumer="acks")
        poison = b"x" * (MIB - 2048)
        await nc.publish(s.ack(job, "recorder"), b"boom")
        await nc.publish(s.ack(job, "recorder"), poison,
                         headers={"ce-type": CommandAck.ce_type()})
        await Bus(nc, s, source="test").publish_durable(s.ack(job, "recorder"), CommandAck(
            command_id="c-1", job=job, responder="x", outcome="done"))
        # Each message runs on its own: the failing one may finish after the other two.
        await wait_until(lambda: seen and dead and errors(rt, "acks", "callback_error"),
                         timeout=30,  # a loaded CI machine took over 10 s once
                         what="the good ack, the poison's letter and the failing callback")
        assert [a.command_id for a in seen] == ["c-1"]
        letter = dead[0]
        assert (letter.consumer, letter.service, letter.truncated) == ("acks", "recorder", True)
        assert letter.size == len(poison) and letter.sha256 == hashlib.sha256(poison).hexdigest()
        assert letter.reason.startswith("malformed command_ack (not JSON)")
        assert errors(rt, "acks", "callback_error") == 1 and errors(rt, "acks", "malformed") == 1


class Pumping(Recorder):
    """Runs a vital loop and a one-off task, each crashing when told to."""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.break_loop = asyncio.Event()

    async def start(self, rt: Runtime) -> None:
        await super().start(rt)

        async def loop() -> None:
            await self.break_loop.wait()
            raise RuntimeError("pump broke")

        rt.spawn(loop(), "pump", vital=True)

    def fail_once(self) -> asyncio.Task[Any]:
        async def request() -> None:
            raise RuntimeError("one request failed")

        return self.runtime.spawn(request(), "request")


async def test_livez_fails_once_a_consumer_or_a_vital_loop_has_died(
        nats_url: str, redis_url: str, prefix: str) -> None:
    svc = Pumping(recorder_settings(nats_url, redis_url, prefix))
    async with running(svc) as rt:
        assert await http_get(rt, "/livez") == (200, "ok\n")
        await asyncio.wait([svc.fail_once()])  # one request's task: logged, not fatal
        assert rt.live() is None and (await http_get(rt, "/livez"))[0] == 200
        consumer = next(t for t in asyncio.all_tasks()
                        if t.get_name() == "recorder:consume:recorder")
        consumer.cancel()
        await wait_until(lambda: rt.live(), what="the consumer's end noticed")
        code, body = await http_get(rt, "/livez")
        assert code == 503 and body == "task recorder:consume:recorder was cancelled\n"
        code, body = await http_get(rt, "/readyz")  # readiness says the same its own way
        assert code == 503 and "consumers not bound: recorder" in body
        svc.break_loop.set()
        await wait_until(lambda: "pump" in (rt.live() or ""), what="the loop's crash noticed")
        code, body = await http_get(rt, "/livez")
        assert code == 503 and "task recorder:pump crashed: RuntimeError('pump broke')" in body
    assert rt.live() is not None  # and stopping adds nothing
    assert "dead-letters" not in (rt.live() or "")
