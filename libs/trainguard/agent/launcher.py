"""``trainguard launch``: torchrun's command line, trainguard's own supervision.

torchrun's options are parsed by torchrun itself (``torch.distributed.run.parse_args`` and
``config_from_args``); the rendezvous is torch's public handler (:mod:`.rendezvous`); the
ranks are supervised here (:mod:`.supervisor`), started cold or from a warm spare
(:mod:`.spares`), with torchrun's environment contract plus ``TRAINGUARD_GENERATION``.
No private torch attribute is touched. Every worker start and exit reaches
:class:`LocalNode`; stuck (stopped or D-state) workers are killed at once instead of
waiting out the SIGTERM grace, and SIGTERM turns into a save-now request (preemption)
before stopping. Defaults differ from stock torchrun where stock behaviour breaks recovery:

* c10d rendezvous with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (stock restarts reuse the
  agent's store and fail on gloo with "Gloo connectFullMesh failed");
* ``--max-restarts 1000``: the remediator's restart budget is the real limit;
* short ``last_call_timeout`` and keep-alive settings so survivors re-form quickly after
  a node leaves;
* each worker's stdout and stderr written to files and tee'd to the console
  (``[rank]:`` prefix), so exits carry their last lines.

Exit codes (the scheduler contract, docs/design.md "Exit codes for schedulers"): the job's
(0, or 1 when workers failed), 200 when this host was isolated or is on the blocklist
(retry the job elsewhere, never on this node), 80 when the control plane held the job (a
crash loop past its restart budget: do not retry, read the incident), 143 after a SIGTERM.
On its way out the launcher announces it left (a ``left`` hello), so the remediator knows
it is no longer in the job.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import ipaddress
import logging
import os
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from trainguard.contract import envnames
from trainguard.contract.errors import ConfigError
from trainguard.contract.schemas import NodeHello, WorkerExit
from trainguard.health import preflight
from trainguard.runtime.embedded import free_port, port_taken

from . import flightrec, logdirs
from .exitcodes import EXIT_HELD, EXIT_ISOLATED, EXIT_STOPPED
from .gpu import GpuSource, ScriptedSource, open_source
from .link import AgentLink
from .node import FLIGHT_RECORDER_PREFIX, LocalNode
from .rankcreds import RankCredentials
from .rendezvous import JobRendezvous, RendezvousFailed, RendezvousPlan
from .settings import AgentSettings
from .spares import SparePool
from .supervisor import Program, Supervisor

log = logging.getLogger("trainguard.agent")


# Keep-alives: 10 misses of 1 s before a node is dropped. With 3, a loaded machine (its
# agents starved for a few seconds) dropped healthy nodes mid-restart, and the re-rendezvous
# then timed out and ended torchrun on the store host: the whole job (issue 16).
RDZV_DEFAULTS = {"last_call_timeout": "2", "keep_alive_interval": "1",
                 "keep_alive_max_attempt": "10", "join_timeout": "300", "close_timeout": "10"}


def _given(argv: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def _is_local(host: str) -> bool:
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def prepare_torchrun(torchrun_argv: list[str], settings: AgentSettings,
                     log_dir: str) -> tuple[argparse.Namespace, bool]:
    """torchrun's own argument parsing, then trainguard's defaults; returns the namespace
    and whether this node hosts the rendezvous store."""
    run_mod: Any = importlib.import_module("torch.distributed.run")
    ns: argparse.Namespace = run_mod.parse_args(torchrun_argv)
    _, max_nodes = run_mod.parse_min_max_nnodes(ns.nnodes)
    if ns.standalone or (ns.rdzv_backend == "static" and not ns.rdzv_endpoint and max_nodes == 1):
        ns.standalone = False
        ns.rdzv_backend = "c10d"
        ns.rdzv_endpoint = f"127.0.0.1:{free_port()}"
        ns.rdzv_id = ns.rdzv_id if ns.rdzv_id != "none" else str(uuid.uuid4())
    if not _given(torchrun_argv, "--max-restarts", "--max_restarts"):
        ns.max_restarts = 1000
    conf = dict(kv.split("=", 1) for kv in ns.rdzv_conf.split(",") if "=" in kv)
    for k, v in RDZV_DEFAULTS.items():
        conf.setdefault(k, v)
    hosts_store = False
    if ns.rdzv_backend == "c10d" and ns.rdzv_endpoint:
        host, _, port = ns.rdzv_endpoint.rpartition(":")
        if "is_host" in conf:
            hosts_store = conf["is_host"].lower() in ("1", "true", "yes")
        elif _is_local(host) and port.isdigit():
            # Decide explicitly instead of letting torch race for the port: the first
            # agent on the endpoint's machine hosts the store, and knows it.
            hosts_store = not port_taken(int(port), host if host != "localhost" else "127.0.0.1")
            conf["is_host"] = "true" if hosts_store else "false"
    elif ns.rdzv_backend == "static":
        hosts_store = ns.node_rank == 0
    ns.rdzv_conf = ",".join(f"{k}={v}" for k, v in conf.items())
    if not _given(torchrun_argv, "--tee", "--redirects", "-t", "-r"):
        ns.tee = "2"
    if not _given(torchrun_argv, "--log-dir", "--log_dir"):
        ns.log_dir = log_dir
    if ns.master_port is None:
        ns.master_port = 29500
    return ns, hosts_store


def worker_environment(settings: AgentSettings, log_dir: str) -> dict[str, str]:
    """What the ranks need so ``Guard()`` takes no arguments, plus collective-failure
    settings that make NCCL fail fast and leave evidence (user values win)."""
    env = {
        envnames.JOB: settings.job,
        envnames.HOST: settings.host,
        envnames.NATS_URL: settings.nats_url,
        envnames.SUBJECT_PREFIX: settings.prefix,
        envnames.ALLOW_DRILLS: "1" if settings.allow_drills else "0",
    }
    # A rank must never inherit the agent's own (wider) access: blank all of it, then hand
    # on the rank role and the CA that verifies the server.
    env.update(dict.fromkeys(envnames.ACCESS, ""))
    env[envnames.CREDENTIALS] = settings.rank_credentials
    if settings.nats_tls_ca:
        env[envnames.NATS_TLS_CA] = settings.nats_tls_ca
    defaults = {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": os.path.join(log_dir, FLIGHT_RECORDER_PREFIX),
        envnames.FR_REQUEST: flightrec.request_path(log_dir),
        "TORCH_NCCL_ENABLE_MONITORING": "1",
    }
    for k, v in defaults.items():
        env.setdefault(k, os.environ.get(k, v))
    return env


def program_of(ns: argparse.Namespace) -> Program:
    """What each rank runs, from torchrun's own arguments."""
    if ns.no_python and ns.module:
        raise ConfigError("--no-python and -m cannot be used together (torchrun's rule)")
    return Program(target=ns.training_script, args=list(ns.training_script_args),
                   module=bool(ns.module), no_python=bool(ns.no_python))


def rendezvous_plan(ns: argparse.Namespace) -> tuple[RendezvousPlan, int, int]:
    """torchrun's own reading of its options (``config_from_args``): the rendezvous, the
    node's process count and the restart limit."""
    run_mod: Any = importlib.import_module("torch.distributed.run")
    config, _, _ = run_mod.config_from_args(ns)
    plan = RendezvousPlan(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                          run_id=config.run_id, min_nodes=config.min_nodes,
                          max_nodes=config.max_nodes, local_addr=config.local_addr,
                          configs=dict(config.rdzv_configs))
    return plan, int(config.nproc_per_node), int(config.max_restarts)


class Stopping(BaseException):
    """A signal ends the launcher (preemption, isolate, stop, hold).

    A ``BaseException``, as ``KeyboardInterrupt`` is: the signal handler raises it wherever
    the main thread is, often inside a rendezvous store call whose ``except Exception``
    takes a store that went away in its stride. Caught there, an isolation was lost: the
    agent went on, restarted its ranks and took its host back into the job."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"launcher {os.getpid()} got signal {signum}")
        self.signum = signum


def launch(settings: AgentSettings, torchrun_argv: list[str]) -> int:
    """Run the node's ranks until the job ends; returns the process exit code."""
    if settings.warm_spares is not None and settings.warm_spares < 0:
        raise ConfigError(f"warm_spares must be 0 or more, not {settings.warm_spares} "
                          "(--warm-spares N or TRAINGUARD_WARM_SPARES)")
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    removed = logdirs.prune(settings.log_root, job=settings.job, host=settings.host,
                            keep=max(0, settings.log_keep - 1),
                            max_age_s=settings.log_max_age_h * 3600)
    if removed:
        print(f"trainguard launch: removed {len(removed)} old log director"
              f"{'y' if len(removed) == 1 else 'ies'}", flush=True)
    log_dir = str(logdirs.create(settings.log_root, settings.job, settings.host))
    ns, hosts_store = prepare_torchrun(torchrun_argv, settings, log_dir)
    program = program_of(ns)
    plan, nproc, max_restarts = rendezvous_plan(ns)
    rank_creds: RankCredentials | None = None
    if settings.nats_creds and not settings.rank_credentials:
        # jwt mode: each rank gets its own credential from the control plane's issuer.
        rank_creds = RankCredentials(Path(log_dir) / "creds", settings.subjects, settings.job,
                                     settings.host)
        settings = dataclasses.replace(settings, rank_credentials=rank_creds.pattern)
    elif settings.credentials and not settings.rank_credentials:
        print("trainguard launch: warning: this agent has credentials but its ranks get none "
              "(--rank-credentials FILE): a server with auth on will refuse their telemetry",
              flush=True)
    os.environ.update(worker_environment(settings, log_dir))

    gpu: GpuSource | None
    gpu, why = open_source(settings.gpu_reading)
    print(f"trainguard launch: gpu: {'unavailable' if gpu is None else 'nvml'} ({why})",
          flush=True)
    if settings.allow_drills:
        gpu = ScriptedSource(gpus=max(1, settings.scripted_gpus), base=gpu)

    link_box: list[AgentLink] = []

    def publish_exit(exit_msg: WorkerExit) -> None:
        link_box[0].publish(settings.subjects.exit(settings.job, settings.host), exit_msg)

    node = LocalNode(settings, hosts_store=hosts_store, gpu=gpu, publish_exit=publish_exit,
                     log_dir=log_dir)
    node.publish_fr = lambda r: link_box[0].publish(
        settings.subjects.fr(settings.job, settings.host), r)
    node.publish_recovery = lambda r: link_box[0].publish(
        settings.subjects.recovery(settings.job, r.rank), r)
    node.publish_preflight = lambda r: link_box[0].publish(
        settings.subjects.event(settings.job, "preflight"), r)
    hello = NodeHello(job=settings.job, host=settings.host, local_ranks=list(range(nproc)),
                      nnodes_min=plan.min_nodes, nnodes_max=plan.max_nodes,
                      drills_allowed=settings.allow_drills, hosts_store=hosts_store,
                      pid=os.getpid())
    link = AgentLink(settings, node, hello)
    link.rank_credentials = rank_creds
    link_box.append(link)
    link.start()
    link.ready.wait(settings.connect_timeout + 2.0)
    reason = link.blocklisted()
    if reason:
        print(f"trainguard launch: host {settings.host} is on the blocklist ({reason}); "
              f"not joining (exit {EXIT_ISOLATED}: do not retry on this node)", flush=True)
        _leave(link)
        return EXIT_ISOLATED
    if settings.preflight != "off" and not preflight_passes(settings, node, link):
        _leave(link)
        return EXIT_ISOLATED

    supervisor_box: list[Supervisor] = []
    stopping: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        if stopping:
            return  # on the way out: a second signal must not cut the ranks' stop short
        stopping.append(signum)
        if signum == signal.SIGTERM and node.ended_by is None:
            # Preemption: try to save within the grace period, then stop the workers.
            answer = link.request_save(settings.preempt_grace)
            log.warning("SIGTERM: save-now before stopping: %s", answer)
        if supervisor_box:  # before this host's ranks stop: the survivors elsewhere go on
            # in place without them, or stop waiting for them. A hold or a stop is sent to
            # every host: nobody goes on then.
            supervisor_box[0].leaving(
                f"host {settings.host} left the job ({leaving_why(signum)})",
                shrink=node.holding is None and node.stopping is None)
        raise Stopping(signum)

    def leaving_why(signum: int) -> str:
        if node.isolating:
            return f"isolated by command {node.isolating}"
        if node.holding:
            return f"held by command {node.holding}"
        if node.stopping:
            return f"stopped by command {node.stopping}"
        return f"its launcher got signal {signum}"

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    wanted = nproc if settings.warm_spares is None else settings.warm_spares
    spares = SparePool(wanted if program.warmable else 0, os.environ, log_dir,
                       target=[*(["-m"] if program.module else []), program.target])
    node.spare_pids = spares.ready_pids
    code = 1
    try:
        rdzv = JobRendezvous(plan)
        supervisor = Supervisor(node=node, rdzv=rdzv, program=program, nproc=nproc,
                                max_restarts=max_restarts, log_dir=log_dir, spares=spares,
                                stop_grace=settings.stop_grace,
                                refill_delay=settings.spare_refill_delay,
                                in_place=settings.in_place,
                                credentials=link.ensure_rank_credentials if rank_creds
                                else None,
                                renumbered=link.renumber_rank_credentials if rank_creds
                                else None)
        supervisor_box.append(supervisor)
        node.rank_restarter = supervisor.restart_rank
        node.mark_group_restart = rdzv.mark_group_restart
        print(f"trainguard launch: job {settings.job} on host {settings.host} "
              f"(rendezvous {plan.endpoint}, store host: {hosts_store}, "
              f"warm spares: {spares.size}, logs {log_dir})", flush=True)
        code = supervisor.run()
    except Stopping as stop:
        by = node.ended_by
        if by is not None:
            node.workers_stopped(by)
        code = EXIT_ISOLATED if node.isolating else EXIT_STOPPED if node.stopping \
            else 128 + stop.signum
    except RendezvousFailed as exc:
        print(f"trainguard launch: {exc}", flush=True)
        code = 1
    finally:
        spares.close()
        _leave(link)
    if node.holding is not None and code != EXIT_ISOLATED:
        code = EXIT_HELD  # also when the hold landed as the launcher gave up by itself
        print(f"trainguard launch: job {settings.job} held by the control plane; exit "
              f"{EXIT_HELD} (do not retry blindly: see the incident)", flush=True)
    if code == EXIT_STOPPED:
        print(f"trainguard launch: job {settings.job} stopped by command {node.stopping}; "
              f"exit {EXIT_STOPPED} (stopped, not finished: do not retry)", flush=True)
    if code == EXIT_ISOLATED:
        print(f"trainguard launch: host {settings.host} isolated; exit {EXIT_ISOLATED} "
              "(do not retry on this node)", flush=True)
    return code


def preflight_passes(settings: AgentSettings, node: LocalNode, link: AgentLink) -> bool:
    """Run the node's pre-flight before any rank starts (its record goes out as an
    event, on which the remediator's policy blocklists a failed node). False: the node
    failed and ``preflight`` is ``enforce``; it then waits up to
    ``preflight_verdict_wait`` for the blocklist entry, only to say why it stays out."""
    report = node.preflight(trigger="launch")
    print(f"trainguard launch: {preflight.render(report)}", flush=True)
    if report.status != "fail":
        return True
    if settings.preflight == "warn":
        print(f"trainguard launch: warning: host {settings.host} failed its pre-flight "
              f"({report.reason()}); starting the ranks anyway (preflight=warn)", flush=True)
        return True
    deadline = time.monotonic() + settings.preflight_verdict_wait
    entry = link.blocklisted()
    while entry is None and time.monotonic() < deadline:
        time.sleep(0.2)
        entry = link.blocklisted()
    said = f"blocklisted: {entry}" if entry else "no blocklist entry yet"
    print(f"trainguard launch: host {settings.host} failed its pre-flight "
          f"({report.reason()}); {said}; not starting ranks (exit {EXIT_ISOLATED}: do not "
          "retry on this node)", flush=True)
    return False


def _leave(link: AgentLink) -> None:
    """A launcher that exited is no longer in the job: it says so with a ``left`` hello, on
    which the remediator drops its node record, and ends the incidents of a job none of
    whose launchers is left (torchrun gave up) as failed instead of waiting."""
    link.deregister()
    link.close()
