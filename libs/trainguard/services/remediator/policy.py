"""Remediation policy as data: a TOML file (defaults shipped beside this module).

A bad file is refused at start with the line and the reason, never half-applied: it is
decoded by msgspec against the Structs below (:mod:`trainguard.runtime.tomldecode`), so a wrong
type, a negative number, an unknown key or action names the key and its line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args

import msgspec

from trainguard.contract.schemas import (
    OBSERVABLE_ACTIONS,
    Cause,
    JobMode,
    ObservableAction,
    RunMode,
)
from trainguard.runtime.tomldecode import TomlError, convert, fail, parse

CAUSES: Final = frozenset(get_args(Cause))
DEFAULT_POLICY: Final = Path(__file__).with_name("default_policy.toml")


@dataclass(frozen=True)
class CausePolicy:
    actions: tuple[str, ...]
    escalate_after: int = 0
    """Escalate and hold the job instead of restarting it when this cause was diagnosed this
    often within an hour (each diagnosis counts: the crashes of one crash loop too)."""
    isolate_if_sustained_s: float = 0.0


PreflightFailAction = Literal["isolate", "alert", "none"]
PreflightWarnAction = Literal["alert", "none"]


@dataclass(frozen=True)
class PreflightPolicy:
    """What a node's pre-flight record does (``[preflight]``): a failed one blocklists
    the node before it joins (``isolate``), or is only announced (``alert``), or nothing."""

    on_fail: PreflightFailAction = "isolate"
    on_warn: PreflightWarnAction = "none"


@dataclass(frozen=True)
class Policy:
    causes: dict[str, CausePolicy]
    cooldown_s: float = 60.0
    restart_budget_per_hour: int = 6
    """Attempts of a job that may end in an hour (failures torchrun restarted, restarts and
    isolations sent); past it the job is held."""
    ack_timeout_s: float = 20.0
    save_deadline_s: float = 60.0
    resolve_timeout_s: float = 600.0
    escalate_unknown: bool = True
    unknown_grace_s: float = 10.0
    launcher_grace_s: float = 15.0
    """After a crash, how long to wait for the launcher's own restart before restarting."""
    """An unknown cause waits this long for a better diagnosis before a human is paged."""
    preflight: PreflightPolicy = field(default_factory=lambda: PreflightPolicy())
    observe: JobMode = field(default_factory=JobMode)
    """``[observe]``: the mode of every job that has none of its own (``trainguard observe``
    / ``act`` set one, and it wins)."""
    source: str = field(default="", compare=False)

    def for_cause(self, cause: str) -> CausePolicy:
        return self.causes.get(cause) or self.causes.get("unknown") or CausePolicy(("escalate",))


class PolicyError(TomlError):
    pass


NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
PolicyAction = Literal["save_now", "dump", "isolate", "restart", "rollback", "alert",
                       "escalate", "hold", "none"]
ACTIONS: Final = frozenset(get_args(PolicyAction))


class DefaultsFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[defaults]`` as written: a key left out is UNSET, so an override file changes
    only what it names."""

    cooldown_s: NonNegative | msgspec.UnsetType = msgspec.UNSET
    restart_budget_per_hour: Count | msgspec.UnsetType = msgspec.UNSET
    ack_timeout_s: NonNegative | msgspec.UnsetType = msgspec.UNSET
    save_deadline_s: NonNegative | msgspec.UnsetType = msgspec.UNSET
    resolve_timeout_s: NonNegative | msgspec.UnsetType = msgspec.UNSET
    escalate_unknown: bool | msgspec.UnsetType = msgspec.UNSET
    unknown_grace_s: NonNegative | msgspec.UnsetType = msgspec.UNSET
    launcher_grace_s: NonNegative | msgspec.UnsetType = msgspec.UNSET

    def given(self) -> dict[str, Any]:
        return {f: v for f in self.__struct_fields__
                if (v := getattr(self, f)) is not msgspec.UNSET}


class CauseFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One ``[causes.<cause>]`` table."""

    actions: list[PolicyAction]
    escalate_after: Count = 0
    isolate_if_sustained_s: NonNegative = 0.0


class PreflightFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[preflight]`` as written (a key left out: the shipped value)."""

    on_fail: PreflightFailAction | msgspec.UnsetType = msgspec.UNSET
    on_warn: PreflightWarnAction | msgspec.UnsetType = msgspec.UNSET

    def given(self) -> dict[str, Any]:
        return {f: v for f in self.__struct_fields__
                if (v := getattr(self, f)) is not msgspec.UNSET}


class ObserveFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[observe]`` as written (a key left out: the shipped value)."""

    mode: RunMode | msgspec.UnsetType = msgspec.UNSET
    actions: list[ObservableAction] | msgspec.UnsetType = msgspec.UNSET

    def given(self) -> dict[str, Any]:
        return {f: v for f in self.__struct_fields__
                if (v := getattr(self, f)) is not msgspec.UNSET}


class PolicyFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    defaults: DefaultsFile = msgspec.field(default_factory=DefaultsFile)
    preflight: PreflightFile = msgspec.field(default_factory=PreflightFile)
    observe: ObserveFile = msgspec.field(default_factory=ObserveFile)
    causes: dict[str, dict[str, Any]] = {}
    notify: dict[str, Any] = {}
    """``[notify]``: the bridge's routes; it decodes them itself."""


def _decode(text: str, source: str) -> tuple[DefaultsFile, dict[str, CausePolicy],
                                             PreflightFile, ObserveFile]:
    try:
        doc = convert(parse(text, source), PolicyFile, text=text, source=source)
        causes: dict[str, CausePolicy] = {}
        for cause, body in doc.causes.items():
            if cause not in CAUSES:
                raise fail(text, source, ("causes", cause),
                           f"unknown cause {cause!r}; known: {', '.join(sorted(CAUSES))}")
            c = convert(body, CauseFile, text=text, source=source, at=("causes", cause))
            causes[cause] = CausePolicy(tuple(c.actions), c.escalate_after,
                                        float(c.isolate_if_sustained_s))
    except TomlError as exc:  # the remediator's own type, for callers that catch it
        raise PolicyError(exc.source, exc.line, _known(exc.message)) from None
    return doc.defaults, causes, doc.preflight, doc.observe


def _known(message: str) -> str:
    """msgspec names a bad enum value; on-call also wants the choices."""
    if (m := re.search(r"observe\.mode: Invalid enum value (\S+)", message)):
        return f"{message[:m.start()]}observe.mode: unknown mode {m.group(1)}; known: act, observe"
    if (m := re.search(r"observe\.actions(\[\d+\])?: Invalid enum value (\S+)", message)):
        return (f"{message[:m.start()]}observe.actions: {m.group(2)} cannot be observed; "
                f"observable: {', '.join(sorted(OBSERVABLE_ACTIONS))} (alert and escalate "
                "change nothing and always run)")
    if (m := re.search(r"\.actions: Invalid enum value (\S+)", message)):
        return (f"{message[:m.start()]}.actions: unknown action {m.group(1)}; known: "
                f"{', '.join(sorted(ACTIONS))}")
    return message


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    """A policy file's text as a :class:`Policy` (unset defaults: the built-in ones)."""
    defaults, causes, preflight, observe = _decode(text, source)
    return Policy(causes=causes, source=source, preflight=PreflightPolicy(**preflight.given()),
                  observe=JobMode(**observe.given()), **defaults.given())


def load_policy(path: str | Path | None = None) -> Policy:
    """The shipped defaults, overlaid by ``path`` (its causes replace the defaults')."""
    base = parse_policy(DEFAULT_POLICY.read_text(), str(DEFAULT_POLICY))
    if not path:
        return base
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise PolicyError(str(p), 0, f"cannot read policy file: {exc.strerror}") from None
    defaults, causes, preflight, observe = _decode(text, str(p))
    merged = {k: getattr(base, k) for k in DefaultsFile.__struct_fields__} | defaults.given()
    gate = PreflightPolicy(**({"on_fail": base.preflight.on_fail,
                               "on_warn": base.preflight.on_warn} | preflight.given()))
    watch = JobMode(**({"mode": base.observe.mode, "actions": list(base.observe.actions)}
                       | observe.given()))
    return Policy(causes={**base.causes, **causes}, source=str(p), preflight=gate,
                  observe=watch, **merged)
