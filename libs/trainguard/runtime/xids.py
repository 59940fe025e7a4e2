"""NVIDIA's Xid catalog as one table: what each code is, and what it means for a training job.

The detector (which XIDs raise ``gpu_health``) and the diagnoser (which cause an XID points
at, and how sure that is) read this one table, built from ``data/xid-catalog.jsonl``:
NVIDIA's public Xid catalog with its recommended immediate action, and the severity that
NVIDIA's NVSentinel health monitor gives each code (provenance in ``data/README.md``).

trainguard adds two columns, derived from NVIDIA's fields by a rule:

* ``fatal``: the GPU is lost to the job until someone acts on the machine. True when
  NVIDIA's immediate action goes beyond the application (:data:`MACHINE_ACTIONS`: reset the
  GPU, reboot, check the hardware, the NVLink or double-bit ECC workflows, call support);
  false when restarting the application, or nothing, is enough (:data:`JOB_ACTIONS`).
  Where the catalog names no action, NVSentinel's severity decides (``FATAL``).
* ``cause``: :data:`CAUSE_OVERRIDES` where NVIDIA's fields cannot tell a memory error from
  any other reset (ECC and row-remapping codes are ``hbm_ecc``); else ``network`` for the
  NVLink workflows, ``gpu_lost`` when fatal, and ``process_crash`` otherwise (the
  application faulted, the GPU is fine).

The catalog is read on first use, not on import: ``import trainguard`` never loads it, and
only the detector and the diagnoser do.
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Mapping
from typing import Final, Literal

import msgspec

from trainguard.contract.schemas import Cause

CATALOG: Final = "data/xid-catalog.jsonl"

JOB_ACTIONS: Final = frozenset({"RESTART_APP", "IGNORE", "CHECK_UVM", "XID_154",
                                "WORKFLOW_XID_45"})
"""Immediate actions that leave the GPU usable (XID 154 and 45 defer to the Xid logged
with them)."""
LINK_ACTIONS: Final = frozenset({"WORKFLOW_NVLINK_ERR", "WORKFLOW_NVLINK5_ERR"})
MACHINE_ACTIONS: Final = LINK_ACTIONS | {"RESET_GPU", "RESTART_BM", "RESTART_VM",
                                         "CHECK_MECHANICALS", "UPDATE_SWFW",
                                         "CONTACT_SUPPORT", "WORKFLOW_XID_48"}
"""Immediate actions that take the GPU or its node out of service first."""
CAUSE_OVERRIDES: Final[Mapping[int, Cause]] = {
    48: "hbm_ecc",   # double-bit ECC (its own workflow: the rule alone would say gpu_lost)
    63: "hbm_ecc",   # row remapping / page retirement recorded (IGNORE: not fatal)
    64: "hbm_ecc",   # row remapping failed (RESET_GPU)
    92: "hbm_ecc",   # high single-bit ECC rate (IGNORE: not fatal)
    94: "hbm_ecc",   # contained uncorrectable ECC error (RESTART_APP: not fatal)
    140: "hbm_ecc",  # uncorrectable ECC that escaped row remapping (RESET_GPU)
}
"""Where NVIDIA's fields do not name the cause (the rest follows from the rule above)."""


class CatalogLine(msgspec.Struct, kw_only=True):
    """One line of the catalog, in NVIDIA's field names."""

    xid: int
    mnemonic: str
    meaning: str
    action_immediate: str = ""
    action_investigatory: str = ""
    note: str = ""
    nvsentinel_action: str | None = None
    nvsentinel_severity: Literal["FATAL", "NONFATAL"] | None = None
    applies_to_ampere_plus: bool = True


class Xid(msgspec.Struct, frozen=True, kw_only=True):
    """One XID: NVIDIA's facts, and trainguard's reading of them."""

    code: int
    mnemonic: str
    meaning: str
    action: str
    """NVIDIA's immediate action (``RESTART_APP``, ``RESET_GPU``, ...; empty: none given)."""
    severity: str | None
    """NVSentinel's severity (``FATAL``/``NONFATAL``), None where it has no mapping."""
    cause: Cause
    fatal: bool


def is_fatal(line: CatalogLine) -> bool:
    """The rule of the module docstring for ``fatal``."""
    if line.action_immediate in MACHINE_ACTIONS:
        return True
    if line.action_immediate in JOB_ACTIONS:
        return False
    return line.nvsentinel_severity == "FATAL"


def cause_of(line: CatalogLine, fatal: bool) -> Cause:
    """The rule of the module docstring for ``cause``."""
    override = CAUSE_OVERRIDES.get(line.xid)
    if override is not None:
        return override
    if line.action_immediate in LINK_ACTIONS:
        return "network"
    return "gpu_lost" if fatal else "process_crash"


def entry(line: CatalogLine) -> Xid:
    fatal = is_fatal(line)
    return Xid(code=line.xid, mnemonic=line.mnemonic, meaning=line.meaning,
               action=line.action_immediate, severity=line.nvsentinel_severity,
               cause=cause_of(line, fatal), fatal=fatal)


def parse(text: str) -> list[CatalogLine]:
    """Every non-blank line of a catalog; a bad line raises msgspec's error naming it."""
    decoder = msgspec.json.Decoder(CatalogLine)
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            try:
                lines.append(decoder.decode(raw))
            except msgspec.DecodeError as exc:
                raise type(exc)(f"{CATALOG} line {number}: {exc}") from None
    return lines


@functools.cache
def table() -> Mapping[int, Xid]:
    """Every catalogued XID by code (read once, on first use)."""
    folder, name = CATALOG.split("/")
    text = importlib.resources.files("trainguard").joinpath(folder).joinpath(name).read_text(
        "utf-8")
    return {line.xid: entry(line) for line in parse(text)}


def lookup(code: int) -> Xid | None:
    """The catalog's entry for ``code``; None for a code NVIDIA does not list."""
    return table().get(code)


@functools.cache
def fatal_codes() -> frozenset[int]:
    """XIDs that mean the GPU is lost to the job (the detector's ``gpu_health`` default)."""
    return frozenset(code for code, x in table().items() if x.fatal)


def codes_with(cause: Cause) -> frozenset[int]:
    """XIDs whose trainguard cause is ``cause``."""
    return frozenset(code for code, x in table().items() if x.cause == cause)
