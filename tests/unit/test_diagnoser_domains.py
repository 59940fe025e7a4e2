"""Hosts lost together become one ``hosts_lost`` diagnosis per failure domain: grouping by
domain, the window's edges, two domains at once, an unrelated crash, no topology."""

from __future__ import annotations

from trainguard.contract.domains import Domain, Topology
from trainguard.contract.evidence import CrashEvidence, HangEvidence, UnresponsiveEvidence
from trainguard.contract.schemas import Anomaly, Diagnosis
from trainguard.services.diagnoser.rules import Decision, Diagnoser

NOW = 1_000_000.0
WINDOW = 2.0


def topology() -> Topology:
    """16 hosts: h00-h07 on switch sw-1, h08-h15 on sw-2, all in zone z1."""
    return Topology(hosts={
        f"h{i:02d}": [Domain("switch", "sw-1" if i < 8 else "sw-2"), Domain("zone", "z1")]
        for i in range(16)})


def silence(host: int, onset: float = NOW - 5.0, job: str = "j") -> Anomaly:
    ranks = [4 * host + k for k in range(4)]
    return Anomaly(id=f"u{host}", job=job, kind="unresponsive", ranks=ranks,
                   hosts=[f"h{host:02d}"], step=100, onset_at=onset, detected_at=onset + 5,
                   evidence=UnresponsiveEvidence(hb_timeout=5.0))


def diagnoser(topo: Topology | None = None, window: float = WINDOW) -> Diagnoser:
    return Diagnoser(domain_window=window, topology=topo if topo is not None else topology())


def feed(d: Diagnoser, anomalies: list[Anomaly], now: float) -> list[Decision]:
    return [d.on_anomaly(a, now) for a in anomalies]


def settle(d: Diagnoser, anomalies: list[Anomaly], at: float) -> list[Diagnosis]:
    """Held first (as they arrive), then each again once the window is over: what the
    service's redeliveries do. Returns every diagnosis published, in order."""
    held = feed(d, anomalies, at)
    assert all(x.wait > 0 and not x.publish for x in held)
    out: list[Diagnosis] = []
    for x in feed(d, anomalies, at + WINDOW):
        assert x.wait == 0
        out.extend(x.publish)
    return out


def test_one_switch_lost_is_one_diagnosis_naming_it() -> None:
    d = diagnoser()
    lost = [silence(h, NOW - 5.0 + 0.1 * h) for h in range(8)]
    (dx,) = settle(d, lost, NOW)
    assert dx.cause == "hosts_lost" and dx.domain == "switch sw-1"
    assert dx.hosts == [f"h{h:02d}" for h in range(8)] and len(dx.ranks) == 32
    assert sorted(dx.anomaly_ids) == sorted(a.id for a in lost)
    assert dx.onset_at == NOW - 5.0
    assert dx.summary.startswith("switch sw-1: 8 hosts, 32 ranks lost within 0.7 s")
    assert dx.recommended == ["isolate", "restart"]
    assert any("the topology puts 8 hosts on switch sw-1" in e.fact for e in dx.evidence)


def test_two_domains_at_once_are_two_diagnoses() -> None:
    d = diagnoser()
    out = settle(d, [silence(h) for h in (0, 8, 1, 9, 2)], NOW)
    assert sorted((x.domain, len(x.hosts)) for x in out) == [("switch sw-1", 3),
                                                              ("switch sw-2", 2)]


def test_window_edges() -> None:
    d = diagnoser()
    # Onsets exactly the window apart still go together; just past it, apart.
    out = settle(d, [silence(0, NOW - 6.0), silence(1, NOW - 6.0 + WINDOW),
                     silence(2, NOW - 6.0 + WINDOW + 0.01)], NOW)
    causes = sorted((x.cause, tuple(x.hosts)) for x in out)
    assert causes == [("hosts_lost", ("h00", "h01")), ("unknown", ("h02",))]


def test_a_silence_waits_out_the_window_from_when_it_was_seen() -> None:
    d = diagnoser()
    a = silence(0)
    assert d.on_anomaly(a, NOW).wait == WINDOW
    assert d.on_anomaly(a, NOW + 0.5).wait == WINDOW - 0.5  # a redelivery: the rest
    (alone,) = d.on_anomaly(a, NOW + WINDOW).publish
    assert alone.cause == "unknown" and alone.hosts == ["h00"]  # one host: as before


def test_window_zero_is_one_diagnosis_per_host_at_once() -> None:
    d = diagnoser(window=0.0)
    out = [x for dec in feed(d, [silence(h) for h in range(4)], NOW) for x in dec.publish]
    assert [x.cause for x in out] == ["unknown"] * 4


def test_without_topology_hosts_lost_together_say_the_domain_is_unknown() -> None:
    d = diagnoser(Topology())
    (dx,) = settle(d, [silence(h) for h in (0, 8, 12)], NOW)
    assert dx.cause == "hosts_lost" and dx.domain == ""
    assert dx.summary.startswith("hosts lost together: 3 hosts, 12 ranks")
    assert any("domain unknown" in e.fact for e in dx.evidence)


def test_an_unrelated_crash_in_another_domain_stays_separate() -> None:
    d = diagnoser()
    feed(d, [silence(h) for h in range(4)], NOW)
    crash = Anomaly(id="c1", job="j", kind="crash", ranks=[40], hosts=["h10"], step=100,
                    onset_at=NOW, detected_at=NOW,
                    evidence=CrashEvidence(source="worker_exit", exit_code=1,
                                           stderr_tail="torch.OutOfMemoryError: CUDA out of "
                                                       "memory. Tried to allocate 2.00 GiB"))
    (oom,) = d.on_anomaly(crash, NOW + 0.1).publish
    assert oom.cause == "oom" and oom.hosts == ["h10"]
    out = [x for dec in feed(d, [silence(h) for h in range(4)], NOW + WINDOW)
           for x in dec.publish]
    assert [(x.cause, x.domain) for x in out] == [("hosts_lost", "switch sw-1")]
    assert "c1" not in out[0].anomaly_ids


def test_a_hang_while_hosts_go_waits_and_joins_their_loss() -> None:
    d = diagnoser()
    feed(d, [silence(h) for h in range(3)], NOW)
    hang = Anomaly(id="hang", job="j", kind="hang", ranks=[0, 1, 2], hosts=["h00"], step=100,
                   onset_at=NOW - 5, detected_at=NOW,
                   evidence=HangEvidence(culprits=[0, 1, 2], culprit_basis="silent",
                                         majority_phase="comm"))
    assert d.on_anomaly(hang, NOW + 0.5).wait == WINDOW - 0.5
    (lost,) = [x for dec in feed(d, [silence(h) for h in range(3)], NOW + WINDOW)
               for x in dec.publish]
    ranks = list(lost.ranks)
    (joined,) = d.on_anomaly(hang, NOW + WINDOW + 0.1).publish
    assert joined.id == lost.id and "hang" in joined.anomaly_ids
    assert joined.collateral == ["hang"] and joined.ranks == ranks  # a consequence only


def test_a_late_silence_of_the_same_domain_widens_the_diagnosis() -> None:
    d = diagnoser()
    (first,) = settle(d, [silence(h) for h in range(3)], NOW)
    (wider,) = d.on_anomaly(silence(3, NOW - 4.0), NOW + WINDOW + 0.5).publish
    assert wider.id == first.id and wider.rev == 2 and "h03" in wider.hosts
    # Another domain's late silence is not this loss.
    assert d.on_anomaly(silence(9, NOW - 4.0), NOW + WINDOW + 0.5).wait > 0


def test_a_silence_that_ends_while_held_is_nobody_s_loss() -> None:
    d = diagnoser()
    feed(d, [silence(0), silence(1)], NOW)
    back = silence(1)
    back.status, back.rev = "resolved", 2
    d.on_anomaly(back, NOW + 1)
    (alone,) = d.on_anomaly(silence(0), NOW + WINDOW).publish
    assert alone.cause == "unknown" and alone.hosts == ["h00"]


def test_a_domain_s_loss_does_not_take_over_another_host_s_guess() -> None:
    d = diagnoser()
    feed(d, [silence(9)], NOW - WINDOW)
    (other,) = d.on_anomaly(silence(9), NOW).publish  # alone on sw-2: unknown
    (dx,) = settle(d, [silence(h) for h in range(3)], NOW + 0.5)
    assert other.cause == "unknown" and other.status == "open"
    assert dx.cause == "hosts_lost" and "u9" not in dx.anomaly_ids
