"""Scheduler hooks: the operator's command that takes an isolated host out of the scheduler
(``isolate_hook``: cordon and taint a Kubernetes node, drain a Slurm node) and the one that
gives it back when its blocklist entry ends (``release_hook``).

A hook is a command template, split like a shell line (``shlex``) but never run by a shell:
each word is filled in on its own (``{host}``, ``{job}``, ``{incident}``, ``{cause}``,
``{reason}``), so a reason with spaces or quotes stays one argument and cannot inject a
command. The same values are in the hook's environment (``TRAINGUARD_HOOK_HOST``, ...). A
hook runs with a timeout in its own process group (killed whole on timeout); its outcome
is a :class:`~trainguard.contract.schemas.HookRun`, kept on the incident step.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import string
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from trainguard.contract import envnames
from trainguard.contract.errors import ConfigError
from trainguard.contract.schemas import HookRun

FIELDS: Final = ("host", "job", "incident", "cause", "reason")
"""What a template may name; anything else is refused at start."""
OUTPUT_TAIL: Final = 2000
"""Characters of a hook's output kept on the incident."""


@dataclass(frozen=True, slots=True)
class Hook:
    """A parsed command template (see the module docstring)."""

    setting: str
    words: tuple[str, ...]

    @classmethod
    def parse(cls, setting: str, template: str) -> Hook | None:
        """None for an empty template (no hook). A template that does not split or names
        an unknown field is a :class:`ConfigError` naming ``setting``."""
        if not template.strip():
            return None
        named = f"{setting} ({envnames.setting(setting)})"
        try:
            words = tuple(shlex.split(template))
        except ValueError as exc:
            raise ConfigError(f"setting {named}={template!r}: {exc} (quote it like a "
                              "shell line)") from None
        formatter = string.Formatter()
        for word in words:
            try:
                names = [name for _, name, _, _ in formatter.parse(word) if name is not None]
            except ValueError as exc:
                raise ConfigError(f"setting {named}: bad template word {word!r}: {exc} "
                                  "(write a literal brace as {{ or }})") from None
            unknown = sorted(set(names) - set(FIELDS))
            if unknown:
                raise ConfigError(
                    f"setting {named}: unknown placeholder {{{unknown[0]}}} in {word!r}; "
                    f"use {', '.join('{' + f + '}' for f in FIELDS)}")
        return cls(setting, words)

    def argv(self, values: Mapping[str, str]) -> list[str]:
        filled = {name: values.get(name, "") for name in FIELDS}
        return [word.format_map(filled) for word in self.words]

    async def run(self, values: Mapping[str, str], timeout: float) -> HookRun:
        """Run the hook for ``values``; never raises for the hook's own failure."""
        argv = self.argv(values)
        env = {**os.environ, **{f"TRAINGUARD_HOOK_{name.upper()}": values.get(name, "")
                                for name in FIELDS}}
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as exc:
            return HookRun(argv=argv, status="error", output=f"{type(exc).__name__}: {exc}",
                           elapsed=time.monotonic() - started)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the hook's children too (kubectl, ssh)
            try:
                out, _ = await asyncio.wait_for(proc.communicate(), 5.0)
            except TimeoutError:  # a grandchild left the group and holds the pipe
                out = b""
            return HookRun(argv=argv, status="timeout", exit_code=proc.returncode,
                           output=_tail(out) + f"\n(killed after {timeout:g} s)",
                           elapsed=time.monotonic() - started)
        code = proc.returncode
        return HookRun(argv=argv, status="ok" if code == 0 else "failed", exit_code=code,
                       output=_tail(out), elapsed=time.monotonic() - started)


def _tail(out: bytes | None) -> str:
    return (out or b"").decode(errors="replace")[-OUTPUT_TAIL:].rstrip()


def summary(run: HookRun) -> str:
    """One line for a step's detail and the logs."""
    if run.status == "ok":
        return f"hook ok ({run.elapsed:.1f} s)"
    last = run.output.strip().splitlines()[-1] if run.output.strip() else ""
    code = f" exit {run.exit_code}" if run.exit_code is not None else ""
    return f"hook {run.status}{code}: {last}"[:300]
