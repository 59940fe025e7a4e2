"""Scheduler hooks: templates refused at start, real processes run with a timeout, and the
shipped Kubernetes and Slurm hooks run against stand-ins for kubectl and scontrol that
record their calls."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from trainguard.contract.errors import ConfigError
from trainguard.contract.schemas import HookRun
from trainguard.services.remediator.hooks import Hook, summary

HOOKS = Path(__file__).resolve().parents[2] / "deploy" / "hooks"

RECORDER = """#!{python}
# A stand-in for {name}: records argv and answers `kubectl get nodes` from $FAKE_NODES.
import json, os, sys, time
with open(os.environ["HOOK_RECORD"], "a") as f:
    f.write(json.dumps({{"tool": "{name}", "argv": sys.argv[1:], "time": time.time()}}) + "\\n")
if sys.argv[1:3] == ["get", "nodes"]:
    print("\\n".join(os.environ.get("FAKE_NODES", "").split(",")))
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


def fake_tools(bin_dir: Path, record: Path, *names: str) -> dict[str, str]:
    """Executables named ``names`` in ``bin_dir`` that record their calls in ``record``;
    returns the environment that puts them first on PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = bin_dir / name
        path.write_text(RECORDER.format(python=sys.executable, name=name))
        path.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOOK_RECORD": str(record)}


def calls(record: Path) -> list[dict[str, object]]:
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text().splitlines()]


@pytest.mark.parametrize(("template", "says"), [
    ("notify {hostname}", "unknown placeholder {hostname}"),
    ("notify 'unclosed", "No closing quotation"),
    ("notify {host", "bad template word"),
])
def test_a_bad_template_is_refused_naming_the_setting(template: str, says: str) -> None:
    with pytest.raises(ConfigError, match="isolate_hook") as info:
        Hook.parse("isolate_hook", template)
    assert says in str(info.value)


def test_an_empty_template_is_no_hook() -> None:
    assert Hook.parse("release_hook", "  ") is None


def test_each_word_is_filled_alone_so_a_reason_cannot_inject() -> None:
    hook = Hook.parse("isolate_hook", "drain --node={host} 'why: {reason}' {{literal}}")
    assert hook is not None
    argv = hook.argv({"host": "node-b", "reason": "ecc; rm -rf / $(id)"})
    assert argv == ["drain", "--node=node-b", "why: ecc; rm -rf / $(id)", "{literal}"]


async def test_a_hook_runs_for_real_with_its_values_in_the_environment(tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    script = tmp_path / "hook.py"
    script.write_text("import json, os, sys\n"
                      "json.dump({'argv': sys.argv[1:], 'host': os.environ['TRAINGUARD_HOOK_HOST'],"
                      " 'job': os.environ['TRAINGUARD_HOOK_JOB']}, open(sys.argv[-1], 'w'))\n"
                      "print('cordoned')\n")
    hook = Hook.parse("isolate_hook", f"{sys.executable} {script} {{host}} {{cause}} {out}")
    assert hook is not None
    run = await hook.run({"host": "node-b", "job": "j1", "cause": "hbm_ecc"}, timeout=60)
    assert (run.status, run.exit_code, run.output) == ("ok", 0, "cordoned")
    assert json.loads(out.read_text()) == {"argv": ["node-b", "hbm_ecc", str(out)],
                                           "host": "node-b", "job": "j1"}
    assert summary(run).startswith("hook ok")


async def test_a_failing_a_missing_and_a_hanging_hook_are_reported_not_raised(
        tmp_path: Path) -> None:
    failing = Hook.parse("isolate_hook",
                         f"{sys.executable} -c \"import sys; print('no such node'); sys.exit(3)\"")
    assert failing is not None
    run = await failing.run({}, timeout=60)
    assert (run.status, run.exit_code) == ("failed", 3)
    assert summary(run) == "hook failed exit 3: no such node"

    missing = Hook.parse("isolate_hook", str(tmp_path / "not-there") + " {host}")
    assert missing is not None
    run = await missing.run({"host": "h"}, timeout=60)
    assert run.status == "error" and "not-there" in run.output

    # The hook starts a child that would outlive it: the whole process group is killed.
    pidfile = tmp_path / "child.pid"
    hanging = Hook.parse("isolate_hook", "sh -c 'sleep 300 & echo $! > " + str(pidfile)
                         + "; wait'")
    assert hanging is not None
    run = await hanging.run({}, timeout=0.5)
    assert run.status == "timeout" and "killed after 0.5 s" in run.output
    child = int(pidfile.read_text())
    await wait_until(lambda: _dead(child), timeout=30, what="the hook's child killed")


def _dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (a container's init may not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


async def test_the_kubernetes_hooks_cordon_taint_and_give_the_node_back(tmp_path: Path) -> None:
    record = tmp_path / "calls.jsonl"
    env = {**os.environ, **fake_tools(tmp_path / "bin", record, "kubectl"),
           "FAKE_NODES": "gpu-1.dc.example,gpu-7.dc.example"}
    isolate = Hook.parse("isolate_hook", f"{HOOKS}/k8s-isolate.sh {{host}} {{reason}}")
    release = Hook.parse("release_hook", f"{HOOKS}/k8s-release.sh {{host}}")
    assert isolate is not None and release is not None
    # The agent's host is the node name with dots as dashes (a subject token has no dots).
    values = {"host": "gpu-7-dc-example", "reason": "xid 79: gpu lost"}
    run = await _in_env(env, isolate.run(values, timeout=60))
    assert run.status == "ok", run.output
    assert [c["argv"] for c in calls(record)][1:] == [
        ["cordon", "gpu-7.dc.example"],
        ["taint", "nodes", "gpu-7.dc.example", "trainguard.io/isolated=true:NoSchedule",
         "--overwrite"],
        ["annotate", "nodes", "gpu-7.dc.example",
         "trainguard.io/isolated-reason=xid 79: gpu lost", "--overwrite"]]
    record.unlink()
    run = await _in_env(env, release.run(values, timeout=60))
    assert run.status == "ok", run.output
    assert [c["argv"] for c in calls(record)][1:] == [
        ["taint", "nodes", "gpu-7.dc.example", "trainguard.io/isolated:NoSchedule-"],
        ["annotate", "nodes", "gpu-7.dc.example", "trainguard.io/isolated-reason-"],
        ["uncordon", "gpu-7.dc.example"]]
    # A host that is no node: the isolate hook fails and says so; nothing is cordoned.
    record.unlink()
    run = await _in_env(env, isolate.run({"host": "node-q"}, timeout=60))
    assert (run.status, run.exit_code) == ("failed", 3) and "no node is named node-q" in run.output
    assert [c["argv"][0] for c in calls(record)] == ["get"]


async def test_the_slurm_hooks_drain_and_resume_the_node(tmp_path: Path) -> None:
    record = tmp_path / "calls.jsonl"
    env = {**os.environ, **fake_tools(tmp_path / "bin", record, "scontrol")}
    isolate = Hook.parse("isolate_hook", f"{HOOKS}/slurm-isolate.sh {{host}} {{reason}}")
    release = Hook.parse("release_hook", f"{HOOKS}/slurm-release.sh {{host}}")
    assert isolate is not None and release is not None
    values = {"host": "gpu-node-12", "reason": "hbm_ecc on rank 3"}
    assert (await _in_env(env, isolate.run(values, timeout=60))).status == "ok"
    assert (await _in_env(env, release.run(values, timeout=60))).status == "ok"
    assert [c["argv"] for c in calls(record)] == [
        ["update", "NodeName=gpu-node-12", "State=DRAIN", "Reason=trainguard: hbm_ecc on rank 3"],
        ["update", "NodeName=gpu-node-12", "State=RESUME"]]


async def _in_env(env: dict[str, str], run: Coroutine[Any, Any, HookRun]) -> HookRun:
    """Hooks inherit the process environment (as in the remediator): run one under
    ``env``, restoring it after."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        return await run
    finally:
        os.environ.clear()
        os.environ.update(saved)
