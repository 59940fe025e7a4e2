"""Remediation policy as data: a TOML file (defaults shipped beside this module).

A bad file is refused at start with the line and the reason, never half-applied.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, get_args

from trainguard.errors import ConfigError
from trainguard.schemas import Cause

ACTIONS: Final = frozenset({"save_now", "dump", "isolate", "restart", "rollback", "alert",
                            "escalate", "hold", "none"})
CAUSES: Final = frozenset(get_args(Cause))
DEFAULT_POLICY: Final = Path(__file__).with_name("default_policy.toml")


@dataclass(frozen=True)
class CausePolicy:
    actions: tuple[str, ...]
    escalate_after: int = 0
    """Escalate and hold the job instead of restarting it when this cause was diagnosed this
    often within an hour (each diagnosis counts: the crashes of one crash loop too)."""
    isolate_if_sustained_s: float = 0.0


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
    source: str = field(default="", compare=False)

    def for_cause(self, cause: str) -> CausePolicy:
        return self.causes.get(cause) or self.causes.get("unknown") or CausePolicy(("escalate",))


class PolicyError(ConfigError):
    pass


def _line_of(text: str, needle: str) -> int:
    for i, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return i
    return 0


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: {exc}") from None

    def fail(needle: str, why: str) -> PolicyError:
        line = _line_of(text, needle)
        return PolicyError(f"{source}, line {line}: {why}" if line else f"{source}: {why}")

    unknown_top = set(raw) - {"defaults", "causes", "notify"}  # [notify]: the bridge's
    if unknown_top:
        name = sorted(unknown_top)[0]
        raise fail(name, f"unknown section [{name}] (expected [defaults], [causes.*] and "
                         "[notify])")
    d: dict[str, Any] = raw.get("defaults", {})
    known = {"cooldown_s", "restart_budget_per_hour", "ack_timeout_s", "save_deadline_s",
             "resolve_timeout_s", "escalate_unknown", "unknown_grace_s",
             "launcher_grace_s"}
    for key, value in d.items():
        if key not in known:
            raise fail(key, f"unknown setting {key!r} in [defaults]; known: "
                            f"{', '.join(sorted(known))}")
        wants_bool = key == "escalate_unknown"
        if wants_bool != isinstance(value, bool) or not isinstance(value, (bool, int, float)):
            raise fail(key, f"{key} must be a {'boolean' if wants_bool else 'number'}")
        if not wants_bool and value < 0:
            raise fail(key, f"{key} must not be negative")
    causes: dict[str, CausePolicy] = {}
    for cause, body in raw.get("causes", {}).items():
        if cause not in CAUSES:
            raise fail(f"causes.{cause}", f"unknown cause {cause!r}; known: "
                                          f"{', '.join(sorted(CAUSES))}")
        if not isinstance(body, dict) or "actions" not in body:
            raise fail(f"causes.{cause}", f"[causes.{cause}] needs an actions list")
        actions = body["actions"]
        if not isinstance(actions, list) or not all(isinstance(a, str) for a in actions):
            raise fail(f"causes.{cause}", f"[causes.{cause}] actions must be a list of strings")
        for action in actions:
            if action not in ACTIONS:
                raise fail(f'"{action}"', f"unknown action {action!r} for {cause}; known: "
                                          f"{', '.join(sorted(ACTIONS))}")
        extra = set(body) - {"actions", "escalate_after", "isolate_if_sustained_s"}
        if extra:
            key = sorted(extra)[0]
            raise fail(key, f"unknown key {key!r} in [causes.{cause}]")
        causes[cause] = CausePolicy(tuple(actions), int(body.get("escalate_after", 0)),
                                    float(body.get("isolate_if_sustained_s", 0.0)))
    return Policy(causes=causes, source=source, **d)


def load_policy(path: str | Path | None = None) -> Policy:
    """The shipped defaults, overlaid by ``path`` (its causes replace the defaults')."""
    base = parse_policy(DEFAULT_POLICY.read_text(), str(DEFAULT_POLICY))
    if not path:
        return base
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise PolicyError(f"cannot read policy file {p}: {exc.strerror}") from None
    override = parse_policy(text, str(p))
    raw = tomllib.loads(text).get("defaults", {})
    merged = {k: getattr(override, k) if k in raw else getattr(base, k)
              for k in ("cooldown_s", "restart_budget_per_hour", "ack_timeout_s",
                        "save_deadline_s", "resolve_timeout_s", "escalate_unknown",
                        "unknown_grace_s", "launcher_grace_s")}
    return Policy(causes={**base.causes, **override.causes}, source=str(p), **merged)


