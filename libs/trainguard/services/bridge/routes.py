"""Routes, grouping and rate limits: the ``[notify]`` section of the policy file.

```toml
[notify]
sinks = ["alertmanager", "webhook", "slack"]   # where an incident goes when no route matches
group_by = ["job", "cause"]     # incidents of one group share a rate limit (and AM groups)
rate_limit = 10                 # new-incident pages per sink and group per rate_window_s
rate_window_s = 3600
repeat_s = 60                   # re-post firing alerts to Alertmanager this often
firing_ttl_s = 86400            # an escalated or failed incident stays firing this long

[[notify.routes]]               # first match wins; an empty list matches anything
causes = ["straggler", "data_pipeline"]
severities = ["warning"]
jobs = []
sinks = ["slack"]
```

Everything here is pure: the service asks :func:`sinks_for` where a notification goes and
a :class:`RateLimiter` whether a group may send now. A bad section is refused at start
with its line and the reason, like the rest of the policy file.
"""

from __future__ import annotations

import tomllib
from collections import deque
from pathlib import Path
from typing import Final, Literal, get_args

import msgspec

from trainguard.contract.errors import ConfigError
from trainguard.contract.schemas import Cause, Severity

Sink = Literal["alertmanager", "webhook", "slack"]
SINKS: Final = get_args(Sink)
PUSH_SINKS: Final = frozenset({"webhook", "slack"})
"""Sinks that reach people directly: rate limited here (Alertmanager groups by itself)."""
GroupKey = Literal["job", "cause", "severity", "host"]


class Route(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    sinks: list[Sink]
    causes: list[Cause] = []
    severities: list[Severity] = []
    jobs: list[str] = []

    def matches(self, job: str, cause: str, severity: str) -> bool:
        return ((not self.causes or cause in self.causes)
                and (not self.severities or severity in self.severities)
                and (not self.jobs or job in self.jobs))


class NotifyPolicy(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    sinks: list[Sink] = msgspec.field(default_factory=lambda: list(SINKS))
    group_by: list[GroupKey] = msgspec.field(default_factory=lambda: ["job", "cause"])
    rate_limit: int = 10
    rate_window_s: float = 3600.0
    repeat_s: float = 60.0
    firing_ttl_s: float = 86400.0
    routes: list[Route] = []


class NotifyPolicyError(ConfigError):
    """The ``[notify]`` section is malformed; the message names the line and the key."""


def _line_of(text: str, key: str, after: int = 0) -> int:
    """The first line past line ``after`` that assigns ``key`` or opens a table named
    ``key`` (comments are not assignments); 0 if none."""
    for i, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0].strip()
        if i > after and (code.startswith((f"{key} ", f"{key}=")) or code.startswith(
                (f"[{key}]", f"[[{key}]]"))):
            return i
    return 0


def _error_line(text: str, exc: msgspec.ValidationError) -> int:
    """The line a msgspec error points at: ``... - at `$.routes[1].sinks[0]``` is the
    ``sinks`` of the second ``[[notify.routes]]``; an unknown field names itself."""
    message = str(exc)
    start = _line_of(text, "notify")
    path = message.rsplit("`$", 1)[-1].rstrip("`") if "`$" in message else ""
    parts = [p for p in path.replace("]", "").replace("[", ".").split(".") if p]
    if len(parts) >= 2 and parts[0] == "routes" and parts[1].isdigit():
        for _ in range(int(parts[1]) + 1):
            start = _line_of(text, "notify.routes", start) or start
        parts = parts[2:]
    keys = [p for p in parts if not p.isdigit()]
    if message.startswith("Object contains unknown field"):
        keys = [message.split("`")[1]]
    return (_line_of(text, keys[0], start) if keys else 0) or start


def parse_notify(text: str, source: str = "<policy>") -> NotifyPolicy:
    """The ``[notify]`` section of a policy file's text (defaults when it has none)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise NotifyPolicyError(f"{source}: {exc}") from None
    section = raw.get("notify", {})
    try:
        policy = msgspec.convert(section, NotifyPolicy)
    except msgspec.ValidationError as exc:
        raise NotifyPolicyError(f"{source}, line {_error_line(text, exc)}: [notify]: "
                                f"{exc}") from None
    start = _line_of(text, "notify")
    for name, value in (("rate_limit", policy.rate_limit), ("rate_window_s", policy.rate_window_s),
                        ("repeat_s", policy.repeat_s), ("firing_ttl_s", policy.firing_ttl_s)):
        if value < 0:
            raise NotifyPolicyError(f"{source}, line {_line_of(text, name, start)}: [notify]: "
                                    f"{name} must not be negative")
    if policy.repeat_s == 0:
        raise NotifyPolicyError(f"{source}, line {_line_of(text, 'repeat_s', start)}: "
                                "[notify]: repeat_s must be positive (Alertmanager resolves an "
                                "alert that is not re-posted)")
    return policy


def load_notify(path: str | Path | None) -> NotifyPolicy:
    """``[notify]`` of the policy file at ``path``; the defaults without one."""
    if not path:
        return NotifyPolicy()
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise NotifyPolicyError(f"cannot read policy file {p}: {exc.strerror}") from None
    return parse_notify(text, str(p))


def sinks_for(policy: NotifyPolicy, job: str, cause: str, severity: str,
              configured: frozenset[str]) -> list[str]:
    """The configured sinks a notification goes to: the first matching route's, else the
    default ones."""
    for route in policy.routes:
        if route.matches(job, cause, severity):
            return [s for s in route.sinks if s in configured]
    return [s for s in policy.sinks if s in configured]


def group_of(policy: NotifyPolicy, labels: dict[str, str]) -> str:
    """The group a notification belongs to, from its labels (``job=a,cause=oom``)."""
    return ",".join(f"{k}={labels.get(k, '')}" for k in policy.group_by)


class RateLimiter:
    """At most ``limit`` sends per group within any ``window`` seconds (0: no limit).

    In memory, by design: a restarted bridge may send a few more, never fewer, and the
    dedupe record (not this) is what keeps a restart from paging twice.
    """

    def __init__(self, limit: int, window: float) -> None:
        self.limit, self.window = limit, window
        self._sent: dict[str, deque[float]] = {}

    def allow(self, group: str, now: float) -> bool:
        """True (and counted) when ``group`` may send now."""
        if self.limit <= 0:
            return True
        times = self._sent.setdefault(group, deque())
        while times and times[0] <= now - self.window:
            times.popleft()
        if len(times) >= self.limit:
            return False
        times.append(now)
        return True
