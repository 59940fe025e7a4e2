"""What the agent does with a command: pure decisions over a :class:`Node`.

Kept free of I/O so the rules (which kinds are ours, epochs, duplicate ids, drills gated,
isolation refused on the rendezvous-store host) are testable without a bus or torch.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Protocol

from trainguard.schemas import AGENT_DRILLS, AGENT_KINDS, AckOutcome, Command


class Node(Protocol):
    """The local side the executor drives (the launcher implements it)."""

    host: str
    hosts_store: bool
    drills_allowed: bool

    def rank_pids(self) -> dict[int, int]: ...

    def restart(self, command_id: str) -> str: ...

    def isolate(self, command_id: str) -> str: ...

    def stop(self, command_id: str) -> str: ...

    def dump(self, ranks: list[int]) -> str: ...

    def signal_rank(self, rank: int, action: str) -> str: ...

    def gpu_drill(self, kind: str, params: dict[str, object]) -> str: ...


@dataclass(frozen=True)
class Outcome:
    outcome: AckOutcome
    detail: str


class CommandExecutor:
    """Runs each command once, in order, refusing stale epochs; returns the ack to send
    (None for commands that are not for this agent)."""

    def __init__(self, node: Node, seen_limit: int = 10_000) -> None:
        self.node = node
        self._seen: collections.OrderedDict[str, Outcome] = collections.OrderedDict()
        self._seen_limit = seen_limit
        self.max_epoch: dict[str, int] = {}
        """Highest epoch seen per issuer (each issuer's leader has its own token)."""

    def handle(self, cmd: Command) -> Outcome | None:
        if cmd.kind not in AGENT_KINDS:
            return None  # a rank's command, broadcast on cmd.all
        if cmd.id in self._seen:
            return None  # redelivered: acknowledged already
        if cmd.retry_of and cmd.retry_of in self._seen \
                and self._seen[cmd.retry_of].outcome == "done":
            return self._remember(cmd, Outcome("done", f"already done as {cmd.retry_of}"))
        highest = self.max_epoch.get(cmd.issuer, 0)
        if cmd.epoch < highest:
            return self._remember(cmd, Outcome(
                "refused", f"stale epoch {cmd.epoch} < {highest} of {cmd.issuer}"))
        self.max_epoch[cmd.issuer] = max(highest, cmd.epoch)
        try:
            detail = self._run(cmd)
        except Refused as exc:
            return self._remember(cmd, Outcome("refused", str(exc)))
        except Exception as exc:
            return self._remember(cmd, Outcome("failed", f"{type(exc).__name__}: {exc}"))
        return self._remember(cmd, Outcome("done", detail))

    def _remember(self, cmd: Command, outcome: Outcome) -> Outcome:
        self._seen[cmd.id] = outcome
        while len(self._seen) > self._seen_limit:
            self._seen.popitem(last=False)
        return outcome

    def _ranks(self, cmd: Command) -> list[int]:
        pids = self.node.rank_pids()
        raw = cmd.params.get("rank", cmd.params.get("ranks"))
        if raw is None:
            return sorted(pids)
        ranks = [int(r) for r in (raw if isinstance(raw, list) else [raw])]
        missing = [r for r in ranks if r not in pids]
        if missing:
            raise Refused(f"rank(s) {missing} do not run on host {self.node.host} "
                          f"(local ranks: {sorted(pids)})")
        return ranks

    def _run(self, cmd: Command) -> str:
        node = self.node
        if cmd.kind in AGENT_DRILLS and not node.drills_allowed:
            raise Refused("drills are disabled for this job: launch it with --allow-drills")
        match cmd.kind:
            case "restart":
                return node.restart(cmd.id)
            case "stop":
                return node.stop(cmd.id)
            case "isolate":
                if node.hosts_store:
                    raise Refused(f"host {node.host} runs the rendezvous store; isolating it "
                                  "would end the job on every node")
                return node.isolate(cmd.id)
            case "dump":
                return node.dump(self._ranks(cmd))
            case "kill" | "freeze" | "thaw":
                ranks = self._ranks(cmd)
                return "; ".join(node.signal_rank(r, cmd.kind) for r in ranks)
            case "ecc" | "xid" | "throttle":
                return node.gpu_drill(cmd.kind, dict(cmd.params))
        raise Refused(f"unknown agent command {cmd.kind!r}")


class Refused(Exception):
    """The command is understood but must not be carried out here."""
