"""A warm spare: a process with the interpreter up and torch and trainguard imported,
waiting to become a rank.

The agent starts it as ``python -u -m trainguard.agent.spare <agent pid> [-m module |
script]`` with pipes on stdin and stdout. Once its imports are done (:func:`preload` too)
it writes ``ready`` on stdout, then
blocks on one line of stdin: a :class:`SpareOrder` (the rank's environment, argv, cwd,
output files and what to run). It applies the order and runs the training script in this
process, as ``python script.py`` / ``python -m module`` would (``runpy``), so the
replacement rank skips the interpreter and torch start; its pid is the rank's pid.

It never outlives the agent: the kernel kills it when the agent dies (``PR_SET_PDEATHSIG``,
checked against the agent's pid so a parent gone before the call is seen too), and an idle
spare exits on end-of-file on stdin (the agent closed the pipe). An idle spare holds only
what the imports allocated.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import importlib
import importlib.util
import os
import runpy
import signal
import sys
import traceback

import msgspec

READY = b"ready\n"
PR_SET_PDEATHSIG = 1


class SpareOrder(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What turns a spare into a rank (agent → its own spare; not a bus message)."""

    env: dict[str, str]
    argv: list[str]
    """``sys.argv`` of the script: the script path (or module name) and its arguments."""
    cwd: str
    stdout: str
    stderr: str
    module: str | None = None
    script: str | None = None


def encode_order(order: SpareOrder) -> bytes:
    return msgspec.json.encode(order) + b"\n"


def _die_with(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the agent was gone before the call took effect
        os._exit(0)


def _warm_up() -> None:
    """What every rank loads before its first step: torch, its distributed package, the
    trainguard client and the checkpoint machinery (a replacement rank loads a checkpoint
    before it trains: DCP costs a second or more to import), and what torch imports lazily
    on a first optimizer step (its compiler stack, seconds on a busy machine), reached
    through the public API on a throwaway one-parameter model."""
    import torch
    import torch.distributed

    import trainguard

    with contextlib.suppress(ImportError):
        import torch.distributed.checkpoint
    with contextlib.suppress(ImportError):
        import trainguard.torch
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.zeros(1, 1)).sum().backward()
    optimizer.step()
    del torch, trainguard, model, optimizer


def top_level_imports(source: str) -> list[tuple[str, list[str]]]:
    """The modules a script imports at its top level, in order, each with the names it
    takes from it (``import a.b``: ``("a.b", [])``; ``from a.b import c``: ``("a.b",
    ["c"])``): what it loads before its first line of training runs."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def target_source(target: str, module: bool, path: list[str]) -> str | None:
    """The source of a script, or of a module found on ``path`` without importing anything
    (a package's ``__init__`` could read the rank's environment, which a spare has not got
    yet): ``a/b/c.py`` or ``a/b/c/__main__.py`` under a ``path`` entry."""
    if not module:
        candidates = [target]
    else:
        rel = os.path.join(*target.split("."))
        candidates = [os.path.join(entry or ".", rel + ext) for entry in path
                      for ext in (".py", os.path.join("", "__main__.py"))]
    for candidate in candidates:
        with contextlib.suppress(OSError, ValueError), open(candidate, encoding="utf-8") as f:
            return f.read()
    return None


def _installed(name: str) -> bool:
    """A module of an installed distribution (its top-level package lives in
    site-packages: importing it runs library code only), or trainguard's own."""
    top = name.split(".")[0]
    if top == "trainguard":
        return True
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is executed
    except (ImportError, ValueError):
        return False
    where = (spec.origin or "") if spec is not None else ""
    if spec is not None and not where and spec.submodule_search_locations:
        where = next(iter(spec.submodule_search_locations), "")
    return "site-packages" in where or "dist-packages" in where


def preload(target: str, module: bool) -> list[str]:
    """Import what the rank's script imports at its top level from installed libraries
    (Lightning, transformers: seconds each), names taken from them included (a library
    that loads its parts lazily, as transformers does, loads them then), so a replacement
    skips that too. The user's own modules are left for the rank: they may act on its
    environment at import. Returns what was imported; what fails to import is the rank's
    to report."""
    source = target_source(target, module, [os.getcwd(), *sys.path[1:]])
    if source is None:
        return []
    try:
        imports = top_level_imports(source)
    except SyntaxError:
        return []
    done = []
    for name, taken in imports:
        if not _installed(name):
            continue
        try:
            loaded = importlib.import_module(name)
            for attr in taken:
                if not hasattr(loaded, attr):  # a submodule not imported by its package
                    importlib.import_module(f"{name}.{attr}")
        except Exception:
            continue
        done.append(name)
    return done


def _redirect(path: str, fd: int) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _become(order: SpareOrder) -> None:
    _redirect(order.stdout, 1)
    _redirect(order.stderr, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(order.env)
    os.chdir(order.cwd)
    threads = order.env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))  # read at import, before the order came
    sys.argv = list(order.argv)


_KEPT: list[object] = []
"""The script's globals (its exception, which holds them, or the copy runpy returns) kept
until this process exits, as ``python script.py`` keeps ``__main__`` alive through its
``atexit`` handlers: freed earlier, the script's process group would close its sockets while
the rank still flushes, its peers would fail first, and the crash would look like theirs."""


def _run(order: SpareOrder) -> int:
    """Run the script as ``__main__``; the exit code python itself would give."""
    try:
        if order.module is not None:
            sys.path[0] = order.cwd
            _KEPT.append(runpy.run_module(order.module, run_name="__main__", alter_sys=True))
        elif order.script is not None:
            sys.path[0] = os.path.dirname(os.path.abspath(order.script))
            _KEPT.append(runpy.run_path(order.script, run_name="__main__"))
    except SystemExit as exc:
        _KEPT.append(exc)
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException as exc:
        _KEPT.append(exc)
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    parent = int(sys.argv[1])
    _die_with(parent)
    _warm_up()
    target = sys.argv[2:]
    if target:
        module = target[0] == "-m"
        preload(target[-1], module)
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    line = sys.stdin.buffer.readline()
    if not line:
        return  # the agent let this spare go
    order = msgspec.json.decode(line, type=SpareOrder)
    sys.stdout.flush()
    _become(order)
    sys.exit(_run(order))


if __name__ == "__main__":
    main()
