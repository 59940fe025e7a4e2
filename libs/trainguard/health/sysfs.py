"""InfiniBand and RoCE ports as sysfs gives them.

Each port directory (``<sysfs>/class/infiniband/<device>/ports/<n>/``) has ``state``
(``4: ACTIVE``), ``phys_state`` (``5: LinkUp``), ``rate`` (``200 Gb/sec (4X HDR)``) and
``link_layer`` (``InfiniBand`` or ``Ethernet``): the kernel's ``Documentation/infiniband/
sysfs.txt``. ``ibstat`` prints the same values. The root is a setting, so a recorded tree
stands in for a host's.
"""

from __future__ import annotations

import os
import re

from trainguard.contract.evidence import IbPort

_RATE = re.compile(r"([\d.]+)\s*Gb/sec")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _word(text: str) -> str:
    """``4: ACTIVE`` -> ``ACTIVE`` (the number before the colon is the spec's code)."""
    return text.split(":", 1)[-1].strip()


def rate_gbps(text: str) -> float | None:
    m = _RATE.search(text)
    return float(m.group(1)) if m else None


def ib_ports(sysfs_root: str) -> list[IbPort]:
    """Every port of every RDMA device under ``sysfs_root`` (empty: none, or no such
    tree), sorted by device and port."""
    base = os.path.join(sysfs_root, "class", "infiniband")
    try:
        devices = sorted(os.listdir(base))
    except OSError:
        return []
    found = []
    for device in devices:
        ports_dir = os.path.join(base, device, "ports")
        try:
            ports = sorted(os.listdir(ports_dir), key=lambda p: int(p) if p.isdigit() else 0)
        except OSError:
            continue
        for port in ports:
            if not port.isdigit():
                continue
            d = os.path.join(ports_dir, port)
            rate = _read(os.path.join(d, "rate"))
            found.append(IbPort(device=device, port=int(port),
                                state=_word(_read(os.path.join(d, "state"))),
                                phys_state=_word(_read(os.path.join(d, "phys_state"))),
                                rate=rate, rate_gbps=rate_gbps(rate),
                                link_layer=_read(os.path.join(d, "link_layer"))))
    return found
