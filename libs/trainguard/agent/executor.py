"""What the agent does with a command: pure decisions over a :class:`Node`.

Kept free of I/O so the rules are testable without a bus or torch. Admission (which kinds
and targets are ours, duplicate ids, retries, epochs) is the library's
:class:`~trainguard.core.receiver.Receiver`, shared with the ranks; what is the agent's own is
here: drills gated, isolation refused on the rendezvous-store host, ranks that must be local.
``restart`` restarts the node's whole group, or with ``params.rank`` that rank alone (a new
generation; the others keep running): in place (the replacement takes its state from the
survivors) when every rank declared it can, else, with ``params.fallback = "group"`` (the
remediator's culprit restart), the whole group, else the rank alone from its checkpoint.
``preflight`` runs the node's passive pre-flight checks now (``params.checks``: which of
``PASSIVE_PREFLIGHT_CHECKS``; the bandwidth test, ``dcgmi diag`` and the disk test would
compete with training, and hold the agent's other commands) and publishes the record.
``hold`` is the control
plane ending a job that cannot recover (a crash loop past its
budget): the workers stop and ``trainguard launch`` exits 80, on every host (the store
host's too: unlike an isolation, the whole job is meant to end).
"""

from __future__ import annotations

from typing import Protocol

from trainguard.contract.errors import TrainguardError
from trainguard.contract.schemas import (
    AGENT_DRILLS,
    PASSIVE_PREFLIGHT_CHECKS,
    Command,
    CommandAck,
)
from trainguard.contract.targets import for_agent
from trainguard.core.receiver import Answer, Drop, Receiver, Unreadable


class Node(Protocol):
    """The local side the executor drives (the launcher implements it)."""

    host: str
    hosts_store: bool
    drills_allowed: bool

    def rank_pids(self) -> dict[int, int]: ...

    def restart(self, command_id: str) -> str: ...

    def restart_rank(self, rank: int, command_id: str, fallback: str = "") -> str: ...

    def isolate(self, command_id: str) -> str: ...

    def stop(self, command_id: str) -> str: ...

    def hold(self, command_id: str) -> str: ...

    def dump(self, ranks: list[int]) -> str: ...

    def signal_rank(self, rank: int, action: str) -> str: ...

    def gpu_drill(self, kind: str, params: dict[str, object]) -> str: ...

    def preflight_summary(self, checks: list[str] | None) -> str: ...


FALLBACKS = frozenset({"", "group"})
"""``restart`` with ``params.rank``: what to do when the rank cannot be replaced in place."""


class CommandExecutor:
    """Runs each command once, in order, refusing stale epochs; returns the ack to send
    (None for commands that are not for this agent, or already acknowledged)."""

    def __init__(self, node: Node, seen_limit: int = 10_000) -> None:
        self.node = node
        # Stack dumps are long, and their last lines matter: a larger detail than a rank's.
        self.receiver = Receiver("host", node.host, for_agent, memory=seen_limit,
                                 detail_limit=32_000)

    def handle(self, cmd: Command, ceiling: int | Unreadable | None = None
               ) -> CommandAck | None:
        """``ceiling``: the issuer's current epoch, where the caller read it (or tried:
        :class:`~trainguard.core.receiver.Unreadable`)."""
        verdict = self.receiver.admit(cmd, ceiling)
        if isinstance(verdict, Drop):
            return None
        if isinstance(verdict, Answer):
            return self.receiver.ack(cmd, verdict.outcome, verdict.detail)
        try:
            detail = self._run(cmd)
        except Refused as exc:
            return self.receiver.ack(cmd, "refused", str(exc))
        except Exception as exc:
            return self.receiver.ack(cmd, "failed", f"{type(exc).__name__}: {exc}")
        return self.receiver.ack(cmd, "done", detail)

    def _ranks(self, cmd: Command, among: bool = False) -> list[int]:
        """The local ranks ``cmd`` names (all, when it names none). ``among``: the names are
        the job's ranks of interest, spread over hosts (a hang's culprits, sent to each of
        their hosts): those that run here, refused only when none does; otherwise every
        named rank must run here."""
        pids = self.node.rank_pids()
        raw = cmd.params.get("rank", cmd.params.get("ranks"))
        if raw is None:
            return sorted(pids)
        ranks = [int(r) for r in (raw if isinstance(raw, list) else [raw])]
        missing = [r for r in ranks if r not in pids]
        if missing and not (among and len(missing) < len(ranks)):
            raise Refused(f"rank(s) {missing} do not run on host {self.node.host} "
                          f"(local ranks: {sorted(pids)})")
        return [r for r in ranks if r in pids]

    def _run(self, cmd: Command) -> str:
        node = self.node
        if cmd.kind in AGENT_DRILLS and not node.drills_allowed:
            raise Refused("drills are disabled for this job: launch it with --allow-drills")
        match cmd.kind:
            case "restart":
                if "rank" in cmd.params:  # one rank alone (in place when it can), at a new
                    fallback = str(cmd.params.get("fallback") or "")  # generation
                    if fallback not in FALLBACKS:
                        raise Refused(f"params.fallback {fallback!r} is not one of "
                                      f"{sorted(FALLBACKS)} ('group': restart the group "
                                      "when the rank cannot be replaced in place)")
                    return "; ".join(node.restart_rank(r, cmd.id, fallback)
                                     for r in self._ranks(cmd))
                return node.restart(cmd.id)
            case "stop":
                return node.stop(cmd.id)
            case "hold":
                return node.hold(cmd.id)
            case "isolate":
                if node.hosts_store:
                    raise Refused(f"host {node.host} runs the rendezvous store; isolating it "
                                  "would end the job on every node")
                return node.isolate(cmd.id)
            case "dump":
                return node.dump(self._ranks(cmd, among=True))
            case "kill" | "freeze" | "thaw":
                ranks = self._ranks(cmd)
                return "; ".join(node.signal_rank(r, cmd.kind) for r in ranks)
            case "preflight":
                raw = cmd.params.get("checks")
                names = [str(c).strip() for c in raw] if isinstance(raw, list) else \
                    [c.strip() for c in str(raw).split(",") if c.strip()] if raw else None
                loud = sorted(set(names or ()) - set(PASSIVE_PREFLIGHT_CHECKS))
                if loud:  # they would hold this agent's other commands for minutes
                    raise Refused(f"params.checks {loud} cannot run beside training: a "
                                  f"preflight command runs {', '.join(PASSIVE_PREFLIGHT_CHECKS)}")
                return node.preflight_summary(names)
            case "ecc" | "xid" | "throttle":
                return node.gpu_drill(cmd.kind, dict(cmd.params))
        raise Refused(f"unknown agent command {cmd.kind!r}")


class Refused(TrainguardError):
    """The command is understood but must not be carried out here."""
