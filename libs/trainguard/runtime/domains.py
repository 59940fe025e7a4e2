"""Read the failure domains (:class:`~trainguard.contract.domains.Topology`) from where a
cluster already writes them down, so an operator names no host twice:

* a TOML or JSON file of ``[[domains]]`` (``level``, ``name``, ``hosts``);
* Kubernetes node labels: ``kubectl get nodes -o json`` saved to a file (a ``NodeList``),
  with the zone, rack and switch label keys as settings;
* Slurm's ``topology.conf`` (``SwitchName=s1 Nodes=node[01-32]``, ``SwitchName=s9
  Switches=s[1-4]``): a host's leaf switch, then the switches above it.

Host names in the file and in Slurm lines may be hostlist ranges (``node[01-32,40]``).
Every error is a :class:`ConfigError` naming the setting that named the file.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from trainguard.contract.domains import LEVELS, Domain, DomainLevel, Topology
from trainguard.contract.errors import ConfigError

from . import tomldecode

SETTING = "topology"
"""The setting that names the file (``TRAINGUARD_TOPOLOGY``): what every error names."""


@dataclasses.dataclass(frozen=True)
class LabelKeys:
    """The node labels that name a host's domains (empty: that level is not labelled)."""

    switch: str = "network.topology.kubernetes.io/switch"
    rack: str = "topology.kubernetes.io/rack"
    zone: str = "topology.kubernetes.io/zone"


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    level: DomainLevel
    name: str
    hosts: list[str]


class _File(msgspec.Struct, forbid_unknown_fields=True):
    domains: list[_Entry] = []


_RANGE = re.compile(r"\[([^\]]*)\]")


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's hostlist syntax: ``node[01-03,07],gpu-a`` -> node01 node02 node03 node07
    gpu-a (zero padding kept; several brackets in one name multiply out)."""
    out: list[str] = []
    for part in _split_top(spec):
        names = [""]
        at = 0
        for m in _RANGE.finditer(part):
            names = [n + part[at:m.start()] for n in names]
            names = [n + item for n in names for item in _expand_range(m.group(1), spec)]
            at = m.end()
        tail = part[at:]
        if "[" in tail or "]" in tail:
            raise ValueError(f"unbalanced brackets in hostlist {spec!r}")
        out.extend(n + tail for n in names)
    return out


def _split_top(spec: str) -> list[str]:
    """``spec`` split at the commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in spec.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _expand_range(body: str, spec: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in hostlist {spec!r}")
        if not sep:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") else 0
        if int(hi) < int(lo):
            raise ValueError(f"range {item!r} runs backwards in hostlist {spec!r}")
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def _add(hosts: dict[str, list[Domain]], host: str, domain: Domain) -> None:
    have = hosts.setdefault(host, [])
    if domain not in have:
        have.append(domain)


def _ordered(hosts: dict[str, list[Domain]]) -> Topology:
    """Each host's domains narrowest first (switch, rack, zone; a Slurm tree's switches
    in the order found: leaf first)."""
    return Topology(hosts={h: sorted(ds, key=lambda d: LEVELS.index(d.level))
                           for h, ds in hosts.items()})


def from_table(data: Any, source: str = SETTING, text: str = "") -> Topology:
    """The ``{"domains": [{"level", "name", "hosts"}]}`` table of a TOML or JSON file."""
    table = tomldecode.convert(data, _File, text=text, source=source)
    hosts: dict[str, list[Domain]] = {}
    for i, entry in enumerate(table.domains):
        for spec in entry.hosts:
            try:
                names = expand_hostlist(spec)
            except ValueError as exc:
                raise tomldecode.fail(text, source, ("domains", str(i), "hosts"),
                                      str(exc)) from None
            for host in names:
                _add(hosts, host, Domain(entry.level, entry.name))
    return _ordered(hosts)


def from_node_labels(labels: Mapping[str, Mapping[str, str]],
                     keys: LabelKeys = LabelKeys()) -> Topology:
    """host -> its Kubernetes node labels, as ``keys`` name the levels."""
    hosts: dict[str, list[Domain]] = {}
    for host, have in labels.items():
        for level in LEVELS:
            key = getattr(keys, level)
            if key and have.get(key):
                _add(hosts, host, Domain(level, have[key]))
    return _ordered(hosts)


def from_node_list(data: Mapping[str, Any], keys: LabelKeys = LabelKeys()) -> Topology:
    """``kubectl get nodes -o json``: each item's ``metadata.name`` and ``.labels``."""
    labels = {}
    for item in data.get("items", []):
        meta = item.get("metadata", {}) if isinstance(item, dict) else {}
        if meta.get("name"):
            labels[str(meta["name"])] = {str(k): str(v)
                                         for k, v in (meta.get("labels") or {}).items()}
    return from_node_labels(labels, keys)


def from_slurm(text: str, source: str = SETTING) -> Topology:
    """Slurm's ``topology.conf`` (tree plugin): leaf switches list ``Nodes=``, the
    switches above list ``Switches=``. Each host gets its leaf switch, then its ancestors."""
    leaves: dict[str, list[str]] = {}
    parent: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = dict(_pair(tok, source, number) for tok in line.split())
        name = fields.get("switchname")
        if not name:
            raise ConfigError(f"{source}, line {number}: a line without SwitchName=: {raw!r}")
        try:
            if "nodes" in fields:
                leaves[name] = expand_hostlist(fields["nodes"])
            for child in expand_hostlist(fields.get("switches", "")):
                parent[child] = name
        except ValueError as exc:
            raise ConfigError(f"{source}, line {number}: {exc}") from None
    hosts: dict[str, list[Domain]] = {}
    for leaf, names in leaves.items():
        chain, seen = [leaf], {leaf}
        while chain[-1] in parent and parent[chain[-1]] not in seen:
            chain.append(parent[chain[-1]])
            seen.add(chain[-1])
        for host in names:
            for switch in chain:
                _add(hosts, host, Domain("switch", switch))
    return Topology(hosts=hosts)


def _pair(token: str, source: str, number: int) -> tuple[str, str]:
    key, sep, value = token.partition("=")
    if not sep:
        raise ConfigError(f"{source}, line {number}: {token!r} is not Key=Value")
    return key.lower(), value


def load_topology(path: str, keys: LabelKeys = LabelKeys(), setting: str = SETTING
                  ) -> Topology:
    """The topology in ``path`` (empty: none), its format told by its content: a Slurm
    ``topology.conf``, a Kubernetes ``NodeList``, or a ``domains`` table (TOML or JSON)."""
    if not path:
        return Topology()
    source = f"{setting}={path}"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"setting {setting}={path!r}: cannot read it ({exc.strerror}); "
                          "name a TOML/JSON domains file, a kubectl NodeList or a Slurm "
                          "topology.conf, or leave it empty") from None
    if re.search(r"^\s*SwitchName\s*=", text, re.IGNORECASE | re.MULTILINE):
        return from_slurm(text, source)
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}: not valid JSON ({exc})") from None
        if isinstance(data, dict) and data.get("kind") == "NodeList":
            return from_node_list(data, keys)
        return from_table(data, source)
    return from_table(tomldecode.parse(text, source), source, text)
