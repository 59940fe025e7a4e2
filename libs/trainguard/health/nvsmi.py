"""``nvidia-smi -q`` text as :class:`~trainguard.contract.schemas.GpuStats`.

The same counters NVML gives the agent (``trainguard.agent.gpu``), read from the report
operators already collect: a recorded dump stands in for NVML in drills and tests
(``gpu_reading``), and a reading from a host without NVML bindings can still be checked.
The report is an indented tree of ``Key : Value`` lines; field names moved between driver
releases (``Clocks Throttle Reasons`` became ``Clocks Event Reasons``, ``Power Readings``
``GPU Power Readings``, ECC ``Double Bit`` became ``DRAM Uncorrectable``), and both
spellings are read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from trainguard.contract.schemas import GpuStats

_KV = re.compile(r"^(\s*)(\S.*?)\s+:\s?(.*)$")

THROTTLE_NAMES = {
    "idle": "gpu_idle", "applications clocks setting": "applications_clocks_setting",
    "sw power cap": "sw_power_cap", "hw slowdown": "hw_slowdown", "sync boost": "sync_boost",
    "sw thermal slowdown": "sw_thermal_slowdown", "hw thermal slowdown": "hw_thermal_slowdown",
    "hw power brake slowdown": "hw_power_brake_slowdown",
    "display clock setting": "display_clock_setting",
}
"""The report's names of NVML's throttle (clock event) reasons, as the agent names them."""


@dataclass
class Node:
    key: str
    value: str = ""
    children: list[Node] = field(default_factory=list)

    def get(self, *path: str) -> Node | None:
        node: Node | None = self
        for name in path:
            assert node is not None
            node = next((c for c in node.children if c.key.lower() == name.lower()), None)
            if node is None:
                return None
        return node

    def text(self, *path: str) -> str:
        node = self.get(*path)
        return node.value if node is not None else ""


def tree(text: str) -> Node:
    """The report as a tree by indentation (a heading has no value)."""
    root = Node("")
    stack: list[tuple[int, Node]] = [(-1, root)]
    for raw in text.splitlines():
        if not raw.strip() or raw.lstrip().startswith("="):
            continue
        indent = len(raw) - len(raw.lstrip())
        m = _KV.match(raw)
        node = Node(m.group(2).strip(), m.group(3).strip()) if m else Node(raw.strip())
        while stack[-1][0] >= indent:
            stack.pop()
        stack[-1][1].children.append(node)
        stack.append((indent, node))
    return root


def _num(text: str) -> float | None:
    m = re.match(r"\s*(-?[\d.]+)", text)
    return float(m.group(1)) if m else None


def _int(text: str) -> int | None:
    v = _num(text)
    return int(v) if v is not None else None


def _yes(text: str) -> bool | None:
    t = text.strip().lower()
    return True if t == "yes" else False if t == "no" else None


def _ecc(gpu: Node, scope: str) -> tuple[int | None, int | None]:
    """(correctable, uncorrectable) device-memory errors of ``Volatile``/``Aggregate``."""
    node = gpu.get("ECC Errors", scope)
    if node is None:
        return None, None
    corr = unc = None
    for c in node.children:
        name = c.key.lower()
        if c.children:  # old layout: Single Bit / Double Bit -> Total
            total = _int(c.text("Total"))
            if total is None:
                continue
            if "single" in name:
                corr = (corr or 0) + total
            elif "double" in name:
                unc = (unc or 0) + total
        elif (v := _int(c.value)) is not None:
            if "uncorrectable" in name:
                unc = (unc or 0) + v
            elif "correctable" in name:
                corr = (corr or 0) + v
    return corr, unc


def gpus(text: str) -> list[GpuStats]:
    """Every GPU of one ``nvidia-smi -q`` report, in order."""
    out = []
    heads = [n for n in tree(text).children if n.key.startswith("GPU ") and n.children]
    for index, g in enumerate(heads):
        reasons_node = g.get("Clocks Event Reasons") or g.get("Clocks Throttle Reasons")
        reasons: list[str] = []
        if reasons_node is not None:
            todo = list(reasons_node.children)
            while todo:
                r = todo.pop(0)
                todo.extend(r.children)
                name = THROTTLE_NAMES.get(r.key.lower())
                if name and r.value.lower() == "active":
                    reasons.append(name)
        power = g.get("GPU Power Readings") or g.get("Power Readings")
        link = g.get("PCI", "GPU Link Info")
        mem = g.get("FB Memory Usage")
        pids = []
        procs = g.get("Processes")
        if procs is not None:
            todo = list(procs.children)
            while todo:
                p = todo.pop(0)
                todo.extend(p.children)
                if p.key == "Process ID" and (pid := _int(p.value)) is not None:
                    pids.append(pid)
        corr_v, unc_v = _ecc(g, "Volatile")
        corr_a, unc_a = _ecc(g, "Aggregate")
        mib = 1024 * 1024
        total, used = _num(mem.text("Total")) if mem else None, _num(mem.text("Used")) \
            if mem else None
        out.append(GpuStats(
            index=index, uuid=g.text("GPU UUID"), name=g.text("Product Name"),
            temperature_c=_num(g.text("Temperature", "GPU Current Temp")),
            power_w=_num(power.text("Power Draw")) if power else None,
            power_limit_w=_num(power.text("Current Power Limit") or power.text("Power Limit"))
            if power else None,
            sm_clock_mhz=_num(g.text("Clocks", "SM")),
            throttle_reasons=sorted(reasons),
            util_pct=_num(g.text("Utilization", "Gpu")),
            mem_total=int(total * mib) if total is not None else None,
            mem_used=int(used * mib) if used is not None else None,
            ecc_corrected_volatile=corr_v, ecc_uncorrected_volatile=unc_v,
            ecc_corrected_aggregate=corr_a, ecc_uncorrected_aggregate=unc_a,
            retired_pages_pending=_yes(g.text("Retired Pages", "Pending Page Blacklist")
                                       or g.text("Retired Pages", "Pending Page Retirement")),
            remapped_rows_pending=_yes(g.text("Remapped Rows", "Pending")),
            remapped_rows_failure=_yes(g.text("Remapped Rows", "Remapping Failure Occurred")),
            pcie_replay=_int(g.text("PCI", "Replays Since Reset")),
            pcie_gen=_int(link.text("PCIe Generation", "Current")) if link else None,
            pcie_gen_max=_int(link.text("PCIe Generation", "Max")) if link else None,
            pcie_width=_int(link.text("Link Width", "Current")) if link else None,
            pcie_width_max=_int(link.text("Link Width", "Max")) if link else None,
            processes=pids))
    return out
