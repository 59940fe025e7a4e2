"""The exit-text knowledge against real error lines users pasted into public threads
(tests/fixtures/error-lines*.jsonl: each row cites its thread), plus the rules around it:
the host's OOM evidence, a bare SIGKILL, the watchdog's sequence numbers, the data file's
own checks, and the honest fallback for a text nothing recognises.

The dev rows (error-lines.jsonl, error-lines-dev.jsonl) are the lines the signatures were
written from: every one must be right. The held-out rows (error-lines-heldout.jsonl) were
collected after the signatures were frozen and never used to write one: their accuracy
must stay at or above the floor measured on them. Scoring is honest
(:mod:`trainguard.services.diagnoser.accuracy`): the fallback is right only on a row
labelled ``unrecognised``."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.agent import hostmem
from trainguard.contract.evidence import CrashEvidence
from trainguard.contract.schemas import Anomaly, WorkerExit
from trainguard.runtime import xids
from trainguard.services.bridge.rules import notice
from trainguard.services.diagnoser import accuracy, signatures
from trainguard.services.diagnoser.rules import FALLBACK_CONFIDENCE, UNRECOGNISED, Diagnoser
from trainguard.services.remediator.intake import admit

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
DEV = ("error-lines.jsonl", "error-lines-dev.jsonl")
HELDOUT = "error-lines-heldout.jsonl"
HELDOUT_FLOOR = 0.95
"""Just below the 95.3% (143/150) measured on the second held-out set (the first, 88.7%
on 151 rows, became dev rows when patterns were written from its misses)."""
NOW = 1_000_000.0


def table(*names: str) -> list[accuracy.Row]:
    return [row for name in names for row in accuracy.load(FIXTURES / name)]


def rows() -> list[accuracy.Row]:
    return table(*DEV)


def crash(text: str, *, exit_code: int | None = 1, signal: str | None = None,
          error: str = "", rank: int = 0) -> Anomaly:
    return Anomaly(id=f"a{rank}", job="j", kind="crash", ranks=[rank], hosts=["node-a"],
                   evidence=CrashEvidence(source="worker_exit", exit_code=exit_code,
                                          signal=signal, stderr_tail=text, error=error),
                   onset_at=NOW - 5, detected_at=NOW - 1)


def test_the_tables_cite_a_public_thread_for_every_line_and_share_none() -> None:
    dev, held = rows(), table(HELDOUT)
    assert len(dev) >= 250 and len(held) >= 150
    for row in dev + held:
        assert row.url.startswith("https://github.com/"), row
    # A held-out row was never used to write a pattern: no text (or thread) of it is a
    # dev row's.
    assert not {r.text.strip() for r in dev} & {r.text.strip() for r in held}
    assert not {r.url for r in dev} & {r.url for r in held}
    assert len({(r.url, r.text) for r in dev}) == len(dev)


@pytest.mark.parametrize("row", rows(), ids=lambda r: r.url.removeprefix(
    "https://github.com/")[:60])
def test_real_line_is_classified(row: accuracy.Row) -> None:
    verdict = accuracy.judge(row)
    assert verdict.right, (row.cause, verdict.cause, verdict.recognised, verdict.fact)


def test_held_out_lines_stay_above_the_measured_floor() -> None:
    score = accuracy.score(table(HELDOUT))
    missed = [(m.row.url, m.cause) for m in score.misses]
    assert score.accuracy >= HELDOUT_FLOOR, missed


def test_the_fallback_is_never_right_by_landing_on_a_cause() -> None:
    text = "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x8 and 16x2)"
    labelled = accuracy.Row("process_crash", "application", "https://github.com/x/y", text)
    assert not accuracy.judge(labelled).right
    assert accuracy.judge(accuracy.Row(accuracy.UNRECOGNISED, "application",
                                       "https://github.com/x/y", text)).right


def test_an_unrecognised_exit_is_a_low_confidence_crash_that_says_so() -> None:
    text = "Traceback (most recent call last):\nKeyError: 'target_cat'"
    d = Diagnoser().on_anomaly(crash(text), NOW).publish[-1]
    assert d.cause == "process_crash" and d.confidence == FALLBACK_CONFIDENCE < 0.5
    assert UNRECOGNISED in d.summary
    # The page the bridge sends from the incident carries it.
    incident = admit(d, None, 60.0, NOW).incident
    assert incident is not None
    page = notice(incident)
    assert UNRECOGNISED in page.summary and "KeyError" in page.summary


def test_an_unrecognised_exit_does_not_supersede_a_recognised_guess() -> None:
    d = Diagnoser()
    timeout = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, "
               "OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600013 milliseconds")
    (network,) = d.on_anomaly(crash(timeout, rank=1), NOW).publish
    assert network.cause == "network"
    later = d.on_anomaly(crash("ValueError: bad batch", rank=2), NOW + 1).publish
    assert [x.cause for x in later] == ["process_crash"]
    assert network.status == "open"
    # A recognised root does supersede it.
    ecc = d.on_anomaly(crash("CUDA error: uncorrectable ECC error encountered", rank=3),
                       NOW + 2).publish
    assert network.status == "superseded" and ecc[-1].cause == "hbm_ecc"


@pytest.mark.parametrize(("line", "fix"), [
    ('{"cause": "oom", "url": "https://github.com/a/b", "text": "x"}', "keys"),
    ('{"cause": "bogus", "family": "storage", "url": "https://github.com/a/b", "text": "x"}',
     "not a contract Cause"),
    ('{"cause": "oom", "family": "nope", "url": "https://github.com/a/b", "text": "x"}',
     "family"),
    ('{"cause": "oom", "family": "storage", "url": "a/b", "text": "x"}', "https://"),
    ("not json", "not JSON"),
])
def test_a_bad_table_row_names_its_line_and_the_fix(tmp_path: Path, line: str,
                                                     fix: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"cause": "oom", "family": "storage", "url": "https://github.com/a/b", '
                    '"text": "ok"}\n' + line + "\n")
    with pytest.raises(accuracy.TableError, match=f"t.jsonl:2: .*{fix}"):
        accuracy.load(path)


def test_dataloader_killed_with_host_oom_evidence_is_oom() -> None:
    text = "RuntimeError: DataLoader worker (pid 1817) is killed by signal: Killed."
    alone = Diagnoser().classify(crash(text), NOW)
    assert alone.cause == "data_pipeline"
    evidence = "host OOM evidence: cgroup memory.events oom_kill 0 -> 1"
    with_oom = Diagnoser().classify(crash(text, error=evidence), NOW)
    assert with_oom.cause == "oom"


@pytest.mark.parametrize(("exit_code", "signal"), [(-9, "SIGKILL"), (137, None)])
def test_bare_sigkill_is_oom_but_weakly(exit_code: int, signal: str | None) -> None:
    v = Diagnoser().classify(crash("", exit_code=exit_code, signal=signal), NOW)
    assert v.cause == "oom" and v.confidence < 0.9


def test_sigkill_the_oom_counter_did_not_see_is_a_crash_not_oom() -> None:
    # What the agent adds when its cgroup counter is readable and stayed still.
    evidence = f"{hostmem.NO_OOM} (cgroup oom_kill unchanged)"
    v = Diagnoser().classify(crash("", exit_code=-9, signal="SIGKILL", error=evidence), NOW)
    assert v.cause == "process_crash"
    text = "RuntimeError: DataLoader worker (pid 1817) is killed by signal: Killed."
    assert Diagnoser().classify(crash(text, error=evidence), NOW).cause == "data_pipeline"


def test_other_signals_without_text_stay_process_crash() -> None:
    v = Diagnoser().classify(crash("", exit_code=-11, signal="SIGSEGV"), NOW)
    assert v.cause == "process_crash"


def exit_of(rank: int, host: str, text: str) -> WorkerExit:
    return WorkerExit(id=f"e{rank}", job="j", host=host, rank=rank, exit_code=-6,
                      stderr_tail=text, time=NOW - 1)


def watchdog(rank: int, enqueued: int, completed: int) -> str:
    """The line format of ProcessGroupNCCL.cpp (as in LlamaFactory#6269), numbers varied."""
    return (f"[rank{rank}]:[E1206 18:44:12.715588844 ProcessGroupNCCL.cpp:1664] [PG 1 Rank "
            f"{rank}] Exception (either an error or timeout) detected by watchdog at work: "
            f"{completed + 1}, last enqueued NCCL work: {enqueued}, last completed NCCL "
            f"work: {completed}.")


def test_the_rank_behind_in_the_watchdog_numbers_is_the_suspect() -> None:
    d = Diagnoser()
    d.observe_exit(exit_of(0, "node-a", watchdog(0, 7755, 7752)))
    d.observe_exit(exit_of(1, "node-a", watchdog(1, 7755, 7752)))
    d.observe_exit(exit_of(3, "node-b", watchdog(3, 7752, 7752)))
    v = d.classify(crash(watchdog(0, 7755, 7752)), NOW)
    assert v.cause == "network"
    assert v.ranks == [3] and v.hosts == ["node-b"]


def test_behind_uses_completions_when_every_rank_enqueued_the_same() -> None:
    progress = signatures.watchdog_progress("\n".join(
        [watchdog(0, 811, 807), watchdog(1, 811, 805), watchdog(2, 811, 807)]))
    assert list(signatures.behind(progress)) == [1]
    assert signatures.behind(signatures.watchdog_progress(watchdog(0, 811, 807))) == {}


def test_every_catalogued_xid_has_a_cause_and_an_action() -> None:
    for code, x in xids.table().items():
        m = signatures.match(f"NVRM: Xid (PCI:0000:3b:00): {code}, pid=1")
        assert m is not None and m.cause == x.cause, code
        expected = ("alert",) if x.action == "IGNORE" and not x.fatal else \
            ("restart",) if not x.fatal else None
        assert m.recommended == expected, code


def test_fatal_xid_in_text_isolates_and_ignore_xid_only_alerts() -> None:
    d = Diagnoser()
    gone = d.on_anomaly(crash("NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus"),
                        NOW).publish[-1]
    assert gone.cause == "gpu_lost" and "isolate" in gone.recommended
    d2 = Diagnoser()
    noted = d2.on_anomaly(crash("NVRM: Xid (PCI:0000:00:05): 43, pid=1045242"),
                          NOW).publish[-1]
    assert noted.recommended == ["alert"]


@pytest.mark.parametrize(("text", "fix"), [
    ('[xid]\npattern="x"\nfatal_weight=1\nrestart_weight=1\nignore_weight=1\n'
     '[sigkill]\ncause="oom"\nweight=0.5\nfact="f"\nexit_codes=[]\n'
     '[[signature]]\nname="a"\ncause="bogus"\nweight=0.5\nfact="f"\npatterns=["x"]\n',
     "cause"),
    ('[xid]\npattern="x"\nfatal_weight=1\nrestart_weight=1\nignore_weight=1\n'
     '[sigkill]\ncause="oom"\nweight=0.5\nfact="f"\nexit_codes=[]\n'
     '[[signature]]\nname="a"\ncause="oom"\nweight=0.5\nfact="f"\npatterns=["("]\n',
     "bad regular expression"),
    ('[xid]\npattern="x"\nfatal_weight=1\nrestart_weight=1\nignore_weight=1\n'
     '[sigkill]\ncause="oom"\nweight=0.5\nfact="f"\nexit_codes=[]\n'
     '[[signature]]\nname="a"\ncause="oom"\nweight=0.5\nfact="f"\npatterns=["x"]\nwieght=1\n',
     "wieght"),
])
def test_mistakes_in_the_data_file_name_the_key(text: str, fix: str) -> None:
    with pytest.raises(signatures.SignatureError, match=fix):
        signatures.parse(text)


def test_data_that_differs_from_its_manifest_is_a_data_pipeline_cause() -> None:
    text = ("Traceback (most recent call last):\n  ...\ntrainguard.runs.verify.DataMismatch: "
            "the data under /data differs from manifest 3f2a...: shard-1.bin: size 4000, "
            "not 4096")
    found = signatures.match(text)
    assert found is not None and found.cause == "data_pipeline", found
