"""The agent's half of the flight recorder: ask the local ranks for their c10d dumps, read
them, and hand the diagnoser what they say.

On a ``dump`` (the remediator's first step for a hang) the agent writes a fresh request id
to the request file its ranks watch (``TRAINGUARD_FR_REQUEST``, in the launch log dir; the
ranks' side is :mod:`trainguard.client.frdump`), waits up to a deadline for each live
rank's ``<TORCH_FR_DUMP_TEMP_FILE><rank>`` to carry that id, and summarizes every dump
(:func:`trainguard.analysis.flightrec.summarize`: the per-group sequence numbers, no stack frames)
into a :class:`~trainguard.contract.evidence.FlightRecorderEvidence`. A rank stopped (SIGSTOP, D
state) or dead cannot answer and is not waited for: it is asked and missing, which the
analysis reads as a rank the others wait on. NCCL's own dumps on timeout land at the same
paths and are read the same way.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from trainguard.analysis import flightrec
from trainguard.contract.envelope import uuid7
from trainguard.contract.evidence import FlightRecorderEvidence
from trainguard.contract.schemas import FlightRecorderReport
from trainguard.core.files import write_atomically

log = logging.getLogger("trainguard.agent")

REQUEST_FILE: Final = "fr-request"
WAIT_S: Final = 5.0


def dump_files(log_dir: str, prefix: str, rank: int) -> list[str]:
    """``rank``'s dump files in ``log_dir``: ``<prefix><rank>`` and ``<prefix><rank>.<any>``,
    never another rank's whose number starts with the same digits (rank 1's, not 10's)."""
    mine = f"{prefix}{rank}"
    try:
        names = os.listdir(log_dir)
    except OSError:
        return []
    return sorted(os.path.join(log_dir, n) for n in names
                  if n == mine or n.startswith(f"{mine}."))


def request_path(log_dir: str) -> str:
    return os.path.join(log_dir, REQUEST_FILE)


def _answered(dump: str, token: str) -> bool:
    try:
        return Path(dump + ".id").read_text("utf-8").strip() == token
    except OSError:
        return False


def collect(log_dir: str, prefix: str, pids: Mapping[int, int], stopped: set[int],
            timeout: float = WAIT_S) -> FlightRecorderEvidence:
    """Ask the ranks of ``pids`` for their dumps and read those that came.

    ``prefix``: the dump path prefix (``TORCH_FR_DUMP_TEMP_FILE``); ``stopped``: ranks that
    cannot answer (not waited for)."""
    token = uuid.uuid4().hex
    write_atomically(Path(request_path(log_dir)), token.encode())
    waiting = {r for r in pids if r not in stopped}
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        waiting -= {r for r in waiting if _answered(f"{prefix}{r}", token)}
        if waiting:
            time.sleep(0.05)
    records = []
    for rank in sorted(pids):
        path = f"{prefix}{rank}"
        if not _answered(path, token):
            continue
        try:
            records.append(flightrec.summarize(flightrec.load(path), rank, path))
        except (flightrec.DumpError, OSError) as exc:
            records.append(flightrec.RankRecord(rank=rank, source=path, error=str(exc)))
    if waiting:
        log.info("flight recorder: ranks %s did not dump within %.0f s", sorted(waiting),
                 timeout)
    return FlightRecorderEvidence(asked=sorted(pids), records=records)


def report(job: str, host: str, evidence: FlightRecorderEvidence,
           attempt: int) -> FlightRecorderReport:
    return FlightRecorderReport(id=uuid7(), job=job, host=host, evidence=evidence,
                                attempt=attempt, time=time.time())


def summary(evidence: FlightRecorderEvidence) -> str:
    """One line for the ``dump`` ack."""
    got = [r.rank for r in evidence.records if not r.error]
    missing = sorted(set(evidence.asked) - set(got))
    return (f"flight recorder: dumps of ranks {got}"
            + (f", none from {missing}" if missing else ""))
