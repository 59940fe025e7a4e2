"""Failure domains read from a domains file, Kubernetes node labels and Slurm's
topology.conf (real-looking fixtures in tests/fixtures/topology)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard.contract.domains import Domain
from trainguard.contract.errors import ConfigError
from trainguard.runtime.config import load_settings
from trainguard.runtime.domains import LabelKeys, expand_hostlist, from_node_labels, load_topology
from trainguard.services.diagnoser.service import DiagnoserService
from trainguard.services.diagnoser.settings import DiagnoserSettings

FIXTURES = Path(__file__).parent.parent / "fixtures" / "topology"


def test_hostlist_ranges_keep_padding_and_multiply() -> None:
    assert expand_hostlist("node[01-03,07],gpu-a") == ["node01", "node02", "node03",
                                                       "node07", "gpu-a"]
    assert expand_hostlist("r[1-2]n[8-9]") == ["r1n8", "r1n9", "r2n8", "r2n9"]
    assert expand_hostlist("node[098-101]") == ["node098", "node099", "node100", "node101"]
    with pytest.raises(ValueError, match="backwards"):
        expand_hostlist("n[5-3]")


def test_slurm_topology_gives_each_host_its_leaf_then_the_spine() -> None:
    topo = load_topology(str(FIXTURES / "topology.conf"))
    assert topo.hosts["gpu003"] == [Domain("switch", "leaf1"), Domain("switch", "spine1")]
    assert topo.domain_of("gpu010") == Domain("switch", "leaf2")
    assert topo.members(Domain("switch", "leaf2")) == ["gpu005", "gpu006", "gpu007", "gpu010"]
    assert topo.domain_of("gpu008") is None


def test_domains_file_orders_switch_rack_zone() -> None:
    topo = load_topology(str(FIXTURES / "domains.toml"))
    assert topo.hosts["node06"] == [Domain("switch", "sw-2"), Domain("rack", "r1"),
                                    Domain("zone", "us-east-1a")]
    assert topo.domain_of("node09") == Domain("zone", "us-east-1a")
    assert len(topo.members(Domain("switch", "sw-1"))) == 4


def test_json_domains_file(tmp_path: Path) -> None:
    path = tmp_path / "domains.json"
    path.write_text(json.dumps({"domains": [
        {"level": "rack", "name": "r7", "hosts": ["a[1-2]"]}]}))
    assert load_topology(str(path)).domain_of("a2") == Domain("rack", "r7")


def test_kubernetes_node_list_with_the_label_keys_as_set() -> None:
    keys = LabelKeys(switch="topology.k8s.aws/network-node-layer-3")
    topo = load_topology(str(FIXTURES / "nodes.json"), keys)
    assert topo.hosts["ip-10-0-1-11.ec2.internal"] == [Domain("switch", "nn-7f2b"),
                                                        Domain("zone", "us-east-1a")]
    assert topo.domain_of("ip-10-0-2-40.ec2.internal") == Domain("switch", "nn-0c41")
    assert "ip-10-0-2-41.ec2.internal" not in topo.hosts  # no label: no domain
    # With the default keys only the zone label is found.
    assert load_topology(str(FIXTURES / "nodes.json")).domain_of(
        "ip-10-0-1-12.ec2.internal") == Domain("zone", "us-east-1a")


def test_node_labels_as_an_agent_reads_its_own() -> None:
    topo = from_node_labels({"h1": {"topology.kubernetes.io/zone": "z1",
                                    "topology.kubernetes.io/rack": "r3"}})
    assert topo.hosts["h1"] == [Domain("rack", "r3"), Domain("zone", "z1")]


def test_bad_input_names_the_setting_and_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"topology=.*cannot read"):
        load_topology(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text('[[domains]]\nlevel = "pod"\nname = "x"\nhosts = ["a"]\n')
    with pytest.raises(ConfigError, match=r"line 2: domains.*level"):
        load_topology(str(bad))
    slurm = tmp_path / "topology.conf"
    slurm.write_text("SwitchName=s1 Nodes=n[1-\n")
    with pytest.raises(ConfigError, match="line 1"):
        load_topology(str(slurm))
    assert not load_topology("")


def test_the_diagnoser_refuses_a_negative_window_and_an_unreadable_topology(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"domain_window=-1\.0: must be >= 0"):
        load_settings(DiagnoserSettings, env={"TRAINGUARD_DOMAIN_WINDOW": "-1"})
    settings = load_settings(DiagnoserSettings, env={},
                             overrides={"topology": str(tmp_path / "none.conf")})
    with pytest.raises(ConfigError, match="setting topology="):
        DiagnoserService(settings)
    settings = load_settings(DiagnoserSettings, env={"TRAINGUARD_TOPOLOGY": str(
        FIXTURES / "topology.conf"), "TRAINGUARD_TOPOLOGY_ZONE_LABEL": "z"})
    assert DiagnoserService(settings).rules.lost.domain_of("gpu001") == Domain("switch",
                                                                                "leaf1")
