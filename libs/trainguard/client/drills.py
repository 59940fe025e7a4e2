"""Fault drills a rank runs on itself, for chaos tests and the demo.

Off unless the job was launched with drills allowed (``trainguard launch --allow-drills``
sets ``TRAINGUARD_ALLOW_DRILLS=1``) or ``Guard(allow_drills=True)``. Each drill produces
the real symptom, not a fake event: a blocked main thread, a slower compute phase, a NaN
that all-reduce spreads, a flipped bit in one replica, an exception out of the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from trainguard.contract import envnames
from trainguard.contract.errors import DrillCrash
from trainguard.contract.schemas import Command
from trainguard.core.rankstate import RankState


class Drills:
    """Runs the rank drills on the shared :class:`~.rankstate.RankState`.

    Args:
        state: what the heartbeat shows (``hang`` sets the phase, ``slow`` the factor).
        allowed: whether drills are allowed now (read at each command).
        model: the attached model, or None (``nan`` and ``sdc`` corrupt it).
    """

    def __init__(self, state: RankState, allowed: Callable[[], bool],
                 model: Callable[[], Any]) -> None:
        self.state = state
        self.allowed = allowed
        self.model = model
        self.nan_pending = False
        self.targets: dict[str, Callable[[dict[str, Any]], str]] = {}
        """Drills a helper plays on what it holds (``corrupt_copies``: the Checkpointer's
        buddy copies), by kind."""
        self.on_entry: list[Callable[[], str]] = []
        """Corruptions applied when the next step begins: a fault that happens *during* a
        step, so the checkpoint of the step before it is still clean, as in real life."""

    def handle(self, cmd: Command) -> str:
        if not self.allowed():
            raise PermissionError("drills are disabled for this job: launch it with "
                                  f"--allow-drills ({envnames.ALLOW_DRILLS}=1)")
        target = self.targets.get(cmd.kind)
        if target is not None:
            return target(cmd.params)
        method = getattr(self, f"_{cmd.kind}", None)
        if method is None:
            raise RuntimeError(f"nothing on this rank plays the {cmd.kind} drill")
        return str(method(cmd.params))

    def _hang(self, params: dict[str, Any]) -> str:
        """Block the training thread (heartbeats go on, showing ``phase``)."""
        seconds = float(params.get("seconds", 3600.0))
        phase = str(params.get("phase", "data"))
        state = self.state
        state.enter(phase)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        state.phase = None
        return f"hung {seconds:.1f}s in {phase}"

    def _slow(self, params: dict[str, Any]) -> str:
        factor = float(params.get("factor", 2.0))
        if not 1.0 <= factor <= 100.0:
            raise ValueError(f"slow factor {factor} must be between 1 and 100")
        self.state.slow_factor = factor
        return f"compute phase slowed {factor}x"

    def _nan(self, params: dict[str, Any]) -> str:
        self.nan_pending = True
        model = self.model()
        if model is not None:
            from trainguard.torch.stats import poison_with_nan

            self.on_entry.append(lambda: f"NaN written into {poison_with_nan(model)}")
            return "NaN goes into the first parameter as the next step begins"
        return "next reported loss is NaN"

    def _sdc(self, params: dict[str, Any]) -> str:
        model = self.model()
        if model is None:
            raise RuntimeError("the sdc drill needs guard.attach(model)")
        from trainguard.torch.stats import flip_bit

        bit = int(params.get("bit", 20))
        self.on_entry.append(lambda: flip_bit(model, bit=bit))
        return f"bit {bit} of the first parameter flips as the next step begins"

    def _crash(self, params: dict[str, Any]) -> str:
        raise DrillCrash(str(params.get("message", "trainguard crash drill")))
