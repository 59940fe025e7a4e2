"""What a rank pays before its first step: no service stack, no DCP until it is needed."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("opentelemetry.sdk", "prometheus_client", "redis", "rich", "trainguard.services")


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\n"
                          "print('\\n'.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


def test_the_rank_path_loads_no_service_stack() -> None:
    loaded = _modules_after("import trainguard")
    assert not {m for m in loaded if m.startswith(HEAVY)}
    assert "torch" not in loaded


def test_trainguard_torch_defers_distributed_checkpoint() -> None:
    loaded = _modules_after("import torch, trainguard.torch")
    assert "torch.distributed.checkpoint.state_dict_saver" not in loaded
    assert "torch.distributed.checkpoint.default_planner" not in loaded


def test_a_checkpointer_imports_dcp_in_the_background() -> None:
    loaded = _modules_after(
        "from trainguard.torch.checkpoint import warm_up\n"
        "warm_up().join(120)")
    assert "torch.distributed.checkpoint.state_dict_saver" in loaded
