"""The job's rendezvous and generation, on torch's public elastic API only.

Each round of torch's rendezvous handler (``c10d`` or ``static``, from
``torch.distributed.elastic.rendezvous.registry``) gives this node its group rank among
the nodes, the round's store and the address of the ranks' own store. From those this
module assigns the node's global ranks (nodes publish their local world size in the round's
store; a node's first rank is the sum of the lower group ranks'), and keeps the job's
**generation**: a counter in the rendezvous store (outside the per-round prefix) that rises
by one at every new process group (a round) and at every single-rank restart, so every
rank, every agent and the control plane can tell which incarnation of the group a rank
belongs to.

The **group store** is what the ranks reach at ``MASTER_ADDR:MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE=True``): with the c10d backend a fresh ``TCPStore`` per
round, served by the agent of the round's group rank 0 on the port torch's rendezvous
chose for it (a plain trainer's ``init_process_group`` then never meets an older group's
keys, the reason trainguard sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), and outliving
every rank, so the survivors of a lost rank 0 can still re-form on it (with torch's own
sharing, without that setting, the group store is the one torch's agent serves; with the
static backend it is the rendezvous store). Under
:func:`trainguard.recovery.groupstore.job_prefix` it carries the generation the ranks read (each
single-rank replacement adds one there and to the job-wide counter, so a later round still
draws above it) and the ranks' in-place keys.

**Taking a host back in place.** When a node waits to join (a host that left and came
back), the nodes whose ranks recover in place join the next round *with their ranks still
running* (``next_round(running=...)``). In the round's store every node says whether it
runs a group (:data:`MEMBER_KEY`); the lowest running one decides (:data:`DECISION_KEY`):
when every running node is in the round, at the same generation, and every rank declared
in-place recovery, it records the grown group for the next generation
(:func:`trainguard.recovery.groupstore.plan_growth`, by ``compare_set``), raises the generation, and
the new nodes' ranks join the running group's store as ``TRAINGUARD_JOIN=peers`` ranks
numbered after the running ones, while the running ranks re-form at their next command
agreement. Otherwise the round is an ordinary one: every node restarts its ranks, the
decision saying why.
"""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass, replace
from typing import Any

from trainguard.contract.errors import TrainguardError
from trainguard.recovery import groupstore
from trainguard.recovery import path as inplace

log = logging.getLogger("trainguard.agent")

ROUND_GENERATION_KEY = "trainguard/generation"
GROUP_READY_KEY = "group_ready"
"""``<key>/<generation>`` is set in the group store (under the job prefix) once it holds
the round's generation."""
STORE_TIMEOUT_S = 60.0
NPROC_KEY = "trainguard/nproc/"
EXIT_BARRIER_PREFIX = "trainguard/exit_barrier"
MEMBER_KEY = "trainguard/member/"
"""``<key><group rank>``, in each round's store: what the node runs (JSON; ``{}``: nothing)."""
DECISION_KEY = "trainguard/take_in"
"""In a round with running nodes: whether it takes the new nodes in place (JSON)."""


class RendezvousFailed(TrainguardError):
    """The rendezvous could not form a group (closed, timed out, store gone)."""


@dataclass(frozen=True)
class Round:
    """One formed group of nodes, as this node sees it."""

    group_rank: int
    group_world_size: int
    base_rank: int
    """This node's first global rank."""
    world_size: int
    master_addr: str
    master_port: int
    generation: int
    store: Any
    """The round's store (``torch.distributed.Store``), for the exit barrier."""
    carried: bool = False
    """This node's running ranks go on in the round (it took new nodes in place)."""
    joins: bool = False
    """This node's ranks join a running group, taking their state from its ranks."""
    attempt: int | None = None
    """With ``joins``: the running group's attempt, which the new ranks start at."""


@dataclass(frozen=True)
class RendezvousPlan:
    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None
    configs: dict[str, Any]


class JobRendezvous:
    """The node's side of torch's rendezvous handler plus the job's generation counter."""

    def __init__(self, plan: RendezvousPlan) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

        self.plan = plan
        params = RendezvousParameters(backend=plan.backend, endpoint=plan.endpoint,
                                      run_id=plan.run_id, min_nodes=plan.min_nodes,
                                      max_nodes=plan.max_nodes, local_addr=plan.local_addr,
                                      **plan.configs)
        self.handler: Any = registry.get_rendezvous_handler(params)
        self._job_store: Any = None
        self._group_store: Any = None
        """The current round's group store, under the job prefix (see the module doc)."""
        self._round_store: Any = None
        """Its ``TCPStore`` (the server itself on the round's group rank 0)."""

    @property
    def run_id(self) -> str:
        return str(self.handler.get_run_id())

    @property
    def use_agent_store(self) -> bool:
        """Always: the ranks' store is an agent's (the group store), never rank 0's."""
        return True

    def next_round(self, local_world_size: int, running: Round | None = None, *,
                   host: str = "", attempt: int = 0) -> Round:
        """Join the next round (blocks until the group forms) and assign ranks.

        ``running``: this node's ranks run that group and recover in place (``attempt``:
        its restart count); the round may take the waiting nodes into it without restarting
        them (the returned round is then ``carried``; see the module doc)."""
        from torch.distributed.elastic.rendezvous import RendezvousError

        dist: Any = importlib.import_module("torch.distributed")

        try:
            info = self.handler.next_rendezvous()
        except RendezvousError as exc:
            raise RendezvousFailed(f"rendezvous failed: {exc}") from exc
        store = info.store
        base = store
        while isinstance(base, dist.PrefixStore):  # the TCPStore itself, as ranks reach it
            base = base.underlying_store
        self._job_store = dist.PrefixStore(groupstore.job_prefix(self.run_id), base)
        group_rank, nodes = int(info.rank), int(info.world_size)
        store.set(f"{NPROC_KEY}{group_rank}", str(local_world_size))
        sizes = [int(v) for v in store.multi_get([f"{NPROC_KEY}{i}" for i in range(nodes)])]
        if self.plan.backend != "static" and (taken := self._take_in(
                dist, store, group_rank, sizes, running, host, attempt)) is not None:
            return taken
        if group_rank == 0:
            # One new generation per group: the lowest node draws it, the others read it.
            drawn = self._job_store.add(groupstore.GENERATION, 1)
            store.set(ROUND_GENERATION_KEY, str(drawn))
        generation = int(store.get(ROUND_GENERATION_KEY))
        if self.plan.backend == "static":
            addr, _, port = self.plan.endpoint.rpartition(":")
            master_addr, master_port = addr, int(port)
            self._round_store, self._group_store = None, self._job_store
        else:
            boot = info.bootstrap_store_info
            master_addr, master_port = str(boot.master_addr), int(boot.master_port)
            # torch's own sharing (without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) serves the
            # ranks' store from its agent already: a client of it then, like the others.
            self._open_group_store(dist, master_addr, master_port, generation,
                                   serve=group_rank == 0 and not self.handler.use_agent_store,
                                   seed=group_rank == 0)
        return Round(group_rank=group_rank, group_world_size=nodes,
                     base_rank=sum(sizes[:group_rank]), world_size=sum(sizes),
                     master_addr=master_addr, master_port=master_port,
                     generation=generation, store=store)

    # -- taking nodes in place --------------------------------------------------------
    def _take_in(self, dist: Any, store: Any, group_rank: int, sizes: list[int],
                 running: Round | None, host: str, attempt: int) -> Round | None:
        """The round as a running group taking the new nodes in place; None when it is an
        ordinary one (no node of it runs a group, or the decision says why not)."""
        nodes = len(sizes)
        mine = {} if running is None else {
            "node": running.group_rank, "nodes": running.group_world_size,
            "world": running.world_size, "generation": running.generation,
            "master": [running.master_addr, running.master_port], "attempt": attempt}
        store.set(f"{MEMBER_KEY}{group_rank}", json.dumps({**mine, "host": host}))
        members = [json.loads(v) for v in
                   store.multi_get([f"{MEMBER_KEY}{i}" for i in range(nodes)])]
        old = [i for i, m in enumerate(members) if "node" in m]
        if not old:
            return None
        if group_rank == old[0]:
            store.set(DECISION_KEY, json.dumps(self._decide_take_in(members, old, sizes)))
        decision = json.loads(store.get(DECISION_KEY))
        if "cold" in decision:
            why = str(decision["cold"])
            log.warning("the round restarts every node's ranks, not in place: %s", why)
            return None
        if running is not None:
            return replace(running, group_world_size=int(decision["nodes"]),
                           world_size=int(decision["world"]), store=store, carried=True)
        place = decision["joiners"][str(group_rank)]
        master_addr, master_port = str(decision["master"][0]), int(decision["master"][1])
        generation = int(decision["generation"])
        self._open_running_store(dist, master_addr, master_port)
        return Round(group_rank=int(place[0]), group_world_size=int(decision["nodes"]),
                     base_rank=int(place[1]), world_size=int(decision["world"]),
                     master_addr=master_addr, master_port=master_port,
                     generation=generation, store=store, joins=True,
                     attempt=int(decision["attempt"]))

    def _decide_take_in(self, members: list[dict[str, Any]], old: list[int],
                        sizes: list[int]) -> dict[str, Any]:
        """The lowest running node's decision (see the module doc)."""
        lead = members[old[0]]
        new = [i for i in range(len(members)) if i not in old]
        if len(old) != int(lead["nodes"]):
            return {"cold": f"{len(old)} of the running group's {lead['nodes']} nodes "
                            "came to the round"}
        if any(members[i]["generation"] != lead["generation"] for i in old):
            return {"cold": "the running nodes disagree on the generation"}
        try:
            generation = int(self._group().add(groupstore.GENERATION, 0))
            blocker = inplace.resize_blocker(self.in_place_keys(generation,
                                                                int(lead["world"])))
        except Exception as exc:
            return {"cold": f"the group store does not answer ({exc!r})"}
        if generation != int(lead["generation"]):
            return {"cold": f"the generation moved to {generation} meanwhile"}
        if blocker is not None:
            return {"cold": blocker}
        grown = groupstore.plan_growth(int(lead["world"]), int(lead["nodes"]),
                                       [(str(members[i].get("host") or f"#{i}"), sizes[i])
                                        for i in new])
        record = grown.encode()
        claimed = self._group().compare_set(groupstore.resize_key(generation + 1), "", record)
        if bytes(claimed).decode(errors="replace") != record:
            return {"cold": "another change of the group came first"}
        generation = self.bump_generation()
        joiners, base = {}, int(lead["world"])
        for n, i in enumerate(new):
            joiners[str(i)] = [int(lead["nodes"]) + n, base]
            base += sizes[i]
        log.info("generation %d: %s; the group grows in place to %d ranks", generation,
                 grown.reason, grown.world_size)
        return {"generation": generation, "world": grown.world_size, "nodes": grown.nodes,
                "master": lead["master"], "attempt": lead["attempt"], "joiners": joiners}

    def _open_running_store(self, dist: Any, addr: str, port: int) -> None:
        """A new node's client of the running group's store (its ranks join there)."""
        from datetime import timedelta

        try:
            self._round_store = dist.TCPStore(addr, port, is_master=False,
                                              wait_for_workers=False,
                                              timeout=timedelta(seconds=STORE_TIMEOUT_S))
        except Exception as exc:
            raise RendezvousFailed(f"group store {addr}:{port} unavailable: {exc}") from exc
        self._group_store = dist.PrefixStore(groupstore.job_prefix(self.run_id),
                                             self._round_store)

    def _open_group_store(self, dist: Any, addr: str, port: int, generation: int, *,
                          serve: bool, seed: bool) -> None:
        """The round's group store: served here (``serve``) or a client of it; group rank 0
        (``seed``) raises its generation to the round's and marks it ready, the others
        wait for that mark."""
        from datetime import timedelta

        timeout = timedelta(seconds=STORE_TIMEOUT_S)
        self._group_store = self._round_store = None  # the last round's server goes now
        ready = f"{GROUP_READY_KEY}/{generation}"
        try:
            self._round_store = dist.TCPStore(addr, port, is_master=serve,
                                              wait_for_workers=False, timeout=timeout)
            group = dist.PrefixStore(groupstore.job_prefix(self.run_id), self._round_store)
            if seed:
                behind = generation - int(group.add(groupstore.GENERATION, 0))
                if behind > 0:
                    group.add(groupstore.GENERATION, behind)
                group.set(ready, "1")
            else:
                group.wait([ready], timeout)
        except Exception as exc:  # the round's rank-0 agent went away: the next round tells
            raise RendezvousFailed(f"group store {addr}:{port} unavailable: {exc}") from exc
        self._group_store = group

    def bump_generation(self) -> int:
        """A new generation for a single-rank restart (job-wide: every agent reads it):
        one more in the group store the ranks read, and in the job-wide counter the next
        round draws from, so both stay equal whoever bumps."""
        group, job = self._group(), self._store()
        new = int(group.add(groupstore.GENERATION, 1))
        if group is not job:
            job.add(groupstore.GENERATION, 1)
        return new

    def generation(self) -> int | None:
        """The job's current generation, or None when the store does not answer."""
        try:
            return int(self._group().add(groupstore.GENERATION, 0))
        except Exception as exc:  # the store host left: the next round tells
            log.debug("generation read failed: %r", exc)
            return None

    def mark_leaving(self, reason: str, resize: groupstore.Resize | None = None) -> bool:
        """Say in the group store that this node's ranks leave the job for good.

        With ``resize`` the job goes on in place without them: the record for the next
        generation first, then the generation rises, so a survivor that sees it rise finds
        the record (True). Otherwise, or when another node's change claimed that generation
        first, the ``left`` key (:func:`trainguard.recovery.groupstore.left_key`): survivors stop
        waiting at once. Best effort: a store that does not answer only costs the survivors
        their rejoin timeout."""
        try:
            group = self._group()
            generation = int(group.add(groupstore.GENERATION, 0))
            if resize is not None:
                record = resize.encode()
                stored = group.compare_set(groupstore.resize_key(generation + 1), "", record)
                if bytes(stored).decode(errors="replace") == record:
                    self.bump_generation()
                    return True
                # Another node's change claimed that generation: its group would wait for
                # ours, so say there that we left.
                reason = f"{reason} (another change of the group came first)"
                generation = max(generation + 1, int(group.add(groupstore.GENERATION, 0)))
            group.set(groupstore.left_key(generation), reason)
        except Exception as exc:
            log.debug("could not mark this node as leaving: %r", exc)
        return False

    def mark_group_restart(self, by: str) -> None:
        """Say in the group store that command ``by`` stops this node's ranks so the group
        restarts (:func:`trainguard.recovery.groupstore.restart_key`). Best effort: without
        it, the other nodes' ranks' exits on their lost peers read as failures of their own."""
        try:
            group = self._group()
            generation = int(group.add(groupstore.GENERATION, 0))
            group.set(groupstore.restart_key(generation), by)
        except Exception as exc:
            log.debug("could not mark the group restart: %r", exc)

    def group_restart_by(self) -> str | None:
        """The command that stops the current generation's group, if one does (None also
        when the store does not answer)."""
        try:
            group = self._group()
            key = groupstore.restart_key(int(group.add(groupstore.GENERATION, 0)))
            if not group.check([key]):
                return None
            return bytes(group.get(key)).decode(errors="replace")
        except Exception as exc:
            log.debug("group restart mark unreadable: %r", exc)
            return None

    def resizes(self, after: int, upto: int) -> list[tuple[int, groupstore.Resize]] | None:
        """The resize records of generations ``after+1 .. upto``, oldest first (None: the
        store did not answer)."""
        return groupstore.read_resizes(self._group_store, after, upto)

    def in_place_keys(self, generation: int, world_size: int) -> inplace.InPlaceKeys | None:
        """Ranks of ``generation`` that have not declared in-place recovery, and what the
        others declared of their state (None: the store does not answer, or no round yet):
        :func:`.inplace.read_keys`."""
        if self._group_store is None:
            return None
        return inplace.read_keys(self._group_store, generation, world_size)

    def _store(self) -> Any:
        if self._job_store is None:
            raise RendezvousFailed("no rendezvous round yet")
        return self._job_store

    def _group(self) -> Any:
        if self._group_store is None:
            raise RendezvousFailed("no group store for this round")
        return self._group_store

    def nodes_waiting(self) -> int:
        """Nodes waiting to join or re-form (another node restarted, or a new one came)."""
        try:
            return int(self.handler.num_nodes_waiting())
        except Exception as exc:
            log.debug("num_nodes_waiting failed: %r", exc)
            return 0

    def exit_barrier(self, rnd: Round, timeout: float = 300.0) -> None:
        """Wait for every node's workers to finish before this one leaves (the store host
        leaving early would end the rendezvous under the others)."""
        from torch.distributed.elastic.utils.store import barrier

        try:
            barrier(rnd.store, rnd.group_world_size, key_prefix=EXIT_BARRIER_PREFIX,
                    barrier_timeout=timeout)
        except Exception as exc:
            log.warning("exit barrier: %r", exc)

    def close(self) -> None:
        """Close the rendezvous for every node (the job ended here, for good)."""
        try:
            self.handler.shutdown()
        except Exception as exc:
            log.debug("rendezvous shutdown failed: %r", exc)

