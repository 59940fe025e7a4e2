"""seed_everything: the same seed gives the same draws everywhere a trainer draws from (the
global generators, a DataLoader's order and its workers), and the deterministic flags are
set. Real torch, real worker processes."""

from __future__ import annotations

import logging
import pickle
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from trainguard.torch import Seeds, seed_everything
from trainguard.torch.seed import CUBLAS_WORKSPACE, seed_worker


@pytest.fixture(autouse=True)
def restore_global_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test leaves torch's deterministic flags, the generators and the environment as
    it found them: the rest of the suite runs in this process."""
    monkeypatch.delenv(CUBLAS_WORKSPACE, raising=False)
    flags = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    yield
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[2], flags[3]
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_same_seed_same_draws() -> None:
    seed_everything(1234)
    first = draws()
    seed_everything(1234)
    assert draws() == first
    seed_everything(1235)
    assert draws() != first


def test_large_seed_reaches_numpy_modulo() -> None:
    seeds = seed_everything(2**40 + 7)
    assert seeds.seed == 2**40 + 7
    first = draws()
    seed_everything(2**40 + 7)
    assert draws() == first


@pytest.mark.parametrize("bad", [-1, 2**63, True, 1.5, "7"])
def test_bad_seed_refused(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        seed_everything(bad)


def test_deterministic_flags_set(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    seeds = seed_everything(7)
    assert seeds == Seeds(seed=7, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    # a nondeterministic operation raises rather than warns
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic is True
    assert torch.backends.cudnn.benchmark is False


def test_not_deterministic_leaves_flags() -> None:
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    seeds = seed_everything(7, deterministic=False)
    assert not seeds.deterministic
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark is True


def test_cublas_workspace_set(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    seed_everything(7)
    assert os.environ[CUBLAS_WORKSPACE] == ":4096:8"
    monkeypatch.setenv(CUBLAS_WORKSPACE, ":16:8")  # the launcher's choice stays
    seed_everything(7)
    assert os.environ[CUBLAS_WORKSPACE] == ":16:8"


def test_cublas_workspace_not_set_without_deterministic() -> None:
    import os

    seed_everything(7, deterministic=False)
    assert CUBLAS_WORKSPACE not in os.environ


def test_pythonhashseed_warning(monkeypatch: pytest.MonkeyPatch,
                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with caplog.at_level(logging.WARNING, logger="trainguard.torch"):
        seed_everything(7)
    assert "PYTHONHASHSEED is not set" in caplog.text
    assert "PYTHONHASHSEED=0 torchrun" in caplog.text
    caplog.clear()
    monkeypatch.setenv("PYTHONHASHSEED", "random")
    with caplog.at_level(logging.WARNING, logger="trainguard.torch"):
        seed_everything(7)
    assert "PYTHONHASHSEED is 'random'" in caplog.text
    caplog.clear()
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    with caplog.at_level(logging.WARNING, logger="trainguard.torch"):
        seed_everything(7)
    assert "PYTHONHASHSEED" not in caplog.text


def test_generator_fresh_and_seeded() -> None:
    seeds = seed_everything(99)
    a, b = seeds.generator(), seeds.generator()
    assert a is not b
    assert torch.rand(4, generator=a).tolist() == torch.rand(4, generator=b).tolist()
    assert seeds.generator().initial_seed() == 99


def test_worker_init_fn_picklable() -> None:
    seeds = Seeds(seed=3)
    assert seeds.worker_init_fn is seed_worker
    assert pickle.loads(pickle.dumps(seeds.worker_init_fn)) is seed_worker


class NoisyDataset(Dataset[dict[str, Any]]):
    """Draws from all three generators in ``__getitem__``, as augmentations do."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"i": i, "torch": torch.rand(2), "random": random.random(),
                "numpy": float(np.random.rand())}


def loader_run(seed: int) -> list[dict[str, Any]]:
    seeds = seed_everything(seed)
    loader = DataLoader(NoisyDataset(), batch_size=4, shuffle=True, num_workers=2,
                        generator=seeds.generator(), worker_init_fn=seeds.worker_init_fn)
    before = torch.get_rng_state()
    batches = [{k: v.tolist() for k, v in b.items()} for b in loader]
    # the loader's order and worker seeds came from its own generator
    assert torch.equal(torch.get_rng_state(), before)
    return batches


def test_dataloader_workers_same_batches_across_runs() -> None:
    first = loader_run(5)
    assert len(first) == 4
    assert sorted(i for b in first for i in b["i"]) == list(range(16))
    assert first == loader_run(5)
    assert loader_run(6) != first
    # the two workers drew different values
    assert first[0]["random"] != first[1]["random"]
    assert first[0]["numpy"] != first[1]["numpy"]


def test_seed_worker_seeds_from_torch_initial_seed() -> None:
    torch.manual_seed(2**32 + 11)
    seed_worker(0)
    got = (random.random(), float(np.random.rand()))
    random.seed(11)
    np.random.seed(11)
    assert got == (random.random(), float(np.random.rand()))


def test_deterministic_training_repeats_bit_for_bit() -> None:
    def train() -> list[float]:
        seed_everything(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(5):
            x = torch.randn(4, 8)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    assert train() == train()


def test_resume_retraces_the_loss_curve() -> None:
    """A job stopped after 4 steps and resumed from its state (model, optimizer, the
    loader's position) gives the curve of one that ran 8 steps straight."""
    data = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8).sin()

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Iterator[torch.Tensor]]:
        seeds = seed_everything(11)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = DataLoader(data, batch_size=8, shuffle=True, generator=seeds.generator())
        return model, opt, iter(loader)

    def steps(model: torch.nn.Module, opt: torch.optim.Optimizer,
              batches: Iterator[torch.Tensor], n: int) -> list[float]:
        losses = []
        for _ in range(n):
            loss = model(next(batches)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    model, opt, batches = build()
    straight = steps(model, opt, batches, 8)

    model, opt, batches = build()
    first = steps(model, opt, batches, 4)
    saved = pickle.dumps((model.state_dict(), opt.state_dict()))
    model, opt, batches = build()  # the crash: everything built again
    state, opt_state = pickle.loads(saved)
    model.load_state_dict(state)
    opt.load_state_dict(opt_state)
    for _ in range(4):  # the loader's position
        next(batches)
    assert first + steps(model, opt, batches, 4) == straight
