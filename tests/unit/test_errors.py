"""Every exception class trainguard defines derives from the library's error base."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import trainguard
from trainguard.contract.errors import TrainguardError

SKIP = {"trainguard.__main__"}  # runs the CLI when imported
OPTIONAL = {"torch", "numpy", "pynvml"}  # extras a CPU-only install may lack


def _modules() -> list[str]:
    """The library's modules, the services' included."""
    names = [m.name for m in pkgutil.walk_packages(trainguard.__path__, "trainguard.")]
    return sorted(set(names) - SKIP)


CONTROL_FLOW = {"trainguard.agent.launcher.Stopping"}
"""Not errors: a signal unwinding the launcher, a ``BaseException`` as ``KeyboardInterrupt``
is, so that no ``except Exception`` on its way takes it for a failure."""


def test_every_exception_class_is_a_trainguard_error() -> None:
    defined = []
    for name in _modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name in OPTIONAL:
                continue
            raise
        defined += [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                    if cls.__module__ == name and issubclass(cls, BaseException)]
    assert len(defined) >= 8, defined  # the walk found the library's and services' errors
    assert {c.__module__.split(".")[1] for c in defined} >= {"contract", "runtime", "services"}
    assert [c for c in defined if not issubclass(c, TrainguardError)
            and f"{c.__module__}.{c.__qualname__}" not in CONTROL_FLOW] == []
    assert all(not issubclass(c, Exception) for c in defined
               if f"{c.__module__}.{c.__qualname__}" in CONTROL_FLOW)
