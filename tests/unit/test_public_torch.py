"""No private torch attribute is assigned or overridden anywhere in the project.

A torch upgrade changes private names silently: code that swaps torch's classes by module
global, sets underscored attributes on torch objects or overrides their underscored methods
breaks without an error. This walks every Python file of the tree and resolves names bound
to torch (imports, ``importlib.import_module("torch...")``) to the real objects, so only
real torch attributes count.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TREES = ("libs", "tests", "bench")
MISSING = object()


def _lookup(dotted: str) -> Any:
    """The object a dotted torch path names, importing modules on the way (or MISSING)."""
    parts = dotted.split(".")
    obj: Any = MISSING
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, MISSING)
            if obj is MISSING:
                return MISSING
        return obj
    return obj


class _Checker(ast.NodeVisitor):
    def __init__(self, where: str) -> None:
        self.where = where
        self.bound: dict[str, str] = {}
        self.problems: list[str] = []

    def _resolve(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.split(".")[0] == "torch":
                if a.asname:
                    self.bound[a.asname] = a.name
                else:
                    self.bound["torch"] = "torch"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.split(".")[0] == "torch" and not node.level:
            for a in node.names:
                self.bound[a.asname or a.name] = f"{node.module}.{a.name}"

    def _bind_import_module(self, target: ast.expr, value: ast.expr | None) -> None:
        if (isinstance(target, ast.Name) and isinstance(value, ast.Call)
                and self._call_name(value) == "import_module" and value.args
                and isinstance(value.args[0], ast.Constant)
                and str(value.args[0].value).split(".")[0] == "torch"):
            self.bound[target.id] = str(value.args[0].value)

    @staticmethod
    def _call_name(call: ast.Call) -> str:
        f = call.func
        return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""

    def _assigned(self, target: ast.expr, line: int) -> None:
        if isinstance(target, ast.Attribute):
            self._attr_set(self._resolve(target.value), target.attr, line)

    def _attr_set(self, base: str | None, attr: str, line: int) -> None:
        if base is None:
            return
        current = getattr(_lookup(base), attr, MISSING)
        swapped = inspect.isclass(current) or inspect.isfunction(current) \
            or inspect.ismodule(current) or inspect.isbuiltin(current)
        if attr.startswith("_") or swapped:
            self.problems.append(f"{self.where}:{line}: assigns {base}.{attr}")

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._bind_import_module(t, node.value)
            self._assigned(t, node.lineno)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._bind_import_module(node.target, node.value)
        self._assigned(node.target, node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._assigned(node.target, node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if self._call_name(node) == "setattr" and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant):
            self._attr_set(self._resolve(node.args[0]), str(node.args[1].value), node.lineno)
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [_lookup(b) for b in (self._resolve(x) for x in node.bases) if b]
        for item in node.body:
            private = isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and item.name.startswith("_") and not item.name.endswith("__")
            if private and any(getattr(b, item.name, MISSING) is not MISSING for b in bases):
                self.problems.append(f"{self.where}:{item.lineno}: {node.name} overrides "
                                     f"torch's private {item.name}")
        self.generic_visit(node)


def problems_in(source: str, where: str = "<source>") -> list[str]:
    checker = _Checker(where)
    checker.visit(ast.parse(source))
    return checker.problems


def test_the_checker_finds_the_old_launcher_patch() -> None:
    old = '''
import importlib
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
launcher_api = importlib.import_module("torch.distributed.launcher.api")
class GuardedAgent(LocalElasticAgent):
    def _start_workers(self, worker_group): ...
    def _own_helper(self): ...
    def run(self, role="default"): ...
launcher_api.LocalElasticAgent = GuardedAgent
import torch.distributed as dist
dist._default_pg_timeout = 5
setattr(dist, "_private", 1)
'''
    found = problems_in(old)
    assert len(found) == 4, found
    assert any("overrides torch's private _start_workers" in p for p in found)
    assert any("launcher.api.LocalElasticAgent" in p for p in found)
    # Public settings and the project's own helpers are not patches.
    assert problems_in("import torch\ntorch.backends.cudnn.deterministic = True\n") == []


def test_no_private_torch_attribute_is_assigned_or_overridden() -> None:
    found: list[str] = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            if "torch" in source:
                found += problems_in(source, str(path.relative_to(ROOT)))
    assert found == []
