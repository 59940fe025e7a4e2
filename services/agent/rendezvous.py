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
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

from trainguard.errors import TrainguardError

log = logging.getLogger("trainguard.agent")

GENERATION_KEY = "generation"
ROUND_GENERATION_KEY = "trainguard/generation"
NPROC_KEY = "trainguard/nproc/"
EXIT_BARRIER_PREFIX = "trainguard/exit_barrier"


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

    @property
    def run_id(self) -> str:
        return str(self.handler.get_run_id())

    @property
    def use_agent_store(self) -> bool:
        return bool(self.handler.use_agent_store)

    def next_round(self, local_world_size: int) -> Round:
        """Join the next round (blocks until the group forms) and assign ranks."""
        from torch.distributed.elastic.rendezvous import RendezvousError

        dist: Any = importlib.import_module("torch.distributed")

        try:
            info = self.handler.next_rendezvous()
        except RendezvousError as exc:
            raise RendezvousFailed(f"rendezvous failed: {exc}") from exc
        store = info.store
        base = store.underlying_store if isinstance(store, dist.PrefixStore) else store
        self._job_store = dist.PrefixStore(f"trainguard/{self.run_id}/", base)
        group_rank, nodes = int(info.rank), int(info.world_size)
        store.set(f"{NPROC_KEY}{group_rank}", str(local_world_size))
        sizes = [int(v) for v in store.multi_get([f"{NPROC_KEY}{i}" for i in range(nodes)])]
        if group_rank == 0:
            # One new generation per group: the lowest node draws it, the others read it.
            store.set(ROUND_GENERATION_KEY, str(self._job_store.add(GENERATION_KEY, 1)))
        generation = int(store.get(ROUND_GENERATION_KEY))
        if self.plan.backend == "static":
            addr, _, port = self.plan.endpoint.rpartition(":")
            master_addr, master_port = addr, int(port)
        else:
            boot = info.bootstrap_store_info
            master_addr, master_port = str(boot.master_addr), int(boot.master_port)
        return Round(group_rank=group_rank, group_world_size=nodes,
                     base_rank=sum(sizes[:group_rank]), world_size=sum(sizes),
                     master_addr=master_addr, master_port=master_port,
                     generation=generation, store=store)

    def bump_generation(self) -> int:
        """A new generation for a single-rank restart (job-wide: every agent reads it)."""
        return int(self._store().add(GENERATION_KEY, 1))

    def generation(self) -> int | None:
        """The job's current generation, or None when the store does not answer."""
        try:
            return int(self._store().add(GENERATION_KEY, 0))
        except Exception as exc:  # the store host left: the next round tells
            log.debug("generation read failed: %r", exc)
            return None

    def _store(self) -> Any:
        if self._job_store is None:
            raise RendezvousFailed("no rendezvous round yet")
        return self._job_store

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
