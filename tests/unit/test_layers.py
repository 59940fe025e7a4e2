"""The layers hold at run time too: no two modules import each other, a service process
loads no client, torch or recovery, and ``import trainguard`` loads nothing but itself.
(`make lint` checks the import direction statically: import-linter, pyproject.toml.)"""

from __future__ import annotations

import subprocess
import sys

import grimp


def test_no_two_modules_import_each_other() -> None:
    graph = grimp.build_graph("trainguard", exclude_type_checking_imports=False)
    mutual = sorted({tuple(sorted((a, b))) for a in graph.modules
                     for b in graph.find_modules_directly_imported_by(a)
                     if a in graph.find_modules_directly_imported_by(b)})
    assert mutual == []


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\n"
                          "print('\\n'.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


def test_import_trainguard_loads_only_the_package() -> None:
    loaded = {m for m in _loaded_after("import trainguard") if m.startswith("trainguard")}
    assert loaded == {"trainguard"}


def test_a_service_loads_no_client_torch_or_recovery() -> None:
    loaded = _loaded_after("import trainguard.services.detector.service, "
                           "trainguard.services.remediator.service, "
                           "trainguard.services.checkpointer.service")
    rank_side = ("trainguard.client", "trainguard.torch", "trainguard.recovery", "torch")
    assert sorted(m for m in loaded if m.startswith(rank_side)) == []


def test_the_guard_is_still_one_attribute_away() -> None:
    loaded = _loaded_after("import trainguard; trainguard.Guard")
    assert "trainguard.client.guard" in loaded
    assert not {m for m in loaded if m.startswith(("trainguard.runtime", "trainguard.analysis",
                                                   "torch"))}


def test_the_stub_types_what_the_package_loads_on_first_use() -> None:
    """``__init__.pyi`` is what type checkers see of the lazy ``trainguard`` names."""
    import ast
    from pathlib import Path

    import trainguard

    stub = ast.parse((Path(trainguard.__file__).parent / "__init__.pyi").read_text())
    declared = next(ast.literal_eval(n.value) for n in stub.body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", "") == "__all__" for t in n.targets))
    assert declared == trainguard.__all__
    assert all(getattr(trainguard, name) is not None for name in declared)
