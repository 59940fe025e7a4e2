"""A resume point from the bus can name a directory, never run code in a rank.

Real DCP checkpoints in one process; the crafted files are what an attacker on the bus
would point a rank at (a planted ``.metadata``, an ``extra`` blob with a payload).
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.unit.test_checkpoint_client import make, offline_guard, train
from trainguard.contract.checksum import METADATA_FILE, crc32_of
from trainguard.contract.commit_record import COMMIT_FILE, CommitRecord, encode_commit
from trainguard.contract.schemas import FileDigest, ResumePoint
from trainguard.torch import Checkpointer
from trainguard.torch.trusted import (
    CheckpointRefused,
    confine,
    encode_py_rng,
    from_blob,
    read_metadata,
    restore_py_rng,
)


class Payload:
    """Unpickling this touches ``marker``: proof that code from the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def saved(tmp_path: Path, step: int = 2) -> tuple[Checkpointer, Path]:
    guard = offline_guard()
    model, opt = make()
    ckpt = Checkpointer(guard, tmp_path)
    train(model, opt, 2)
    ckpt.save(step, model, opt, extra={"epoch": 1})
    ckpt.wait()
    return ckpt, ckpt.path_for(step)


def commit(path: Path, job: str = "ckjob", step: int = 2, crc: int | None = None) -> None:
    digest = FileDigest(bytes=(path / METADATA_FILE).stat().st_size,
                        crc32=crc32_of(path / METADATA_FILE) if crc is None else crc)
    (path / COMMIT_FILE).write_bytes(encode_commit(CommitRecord(
        job=job, step=step, path=str(path), files={METADATA_FILE: digest})))


def point(path: Path, step: int = 2) -> ResumePoint:
    return ResumePoint(job="ckjob", step=step, path=str(path))


def test_a_committed_resume_point_loads(tmp_path: Path) -> None:
    ckpt, path = saved(tmp_path)
    commit(path)
    model, opt = make()
    assert ckpt.load(point(path), model, opt) == 2
    assert ckpt.loaded_extra == {"epoch": 1}


@pytest.mark.parametrize("where", ["elsewhere", "other-job", "symlink", "the-job-dir"])
def test_a_resume_point_outside_the_jobs_root_is_refused(tmp_path: Path, where: str) -> None:
    ckpt, _ = saved(tmp_path / "root")
    target = {
        "elsewhere": tmp_path / "planted",
        "other-job": tmp_path / "root" / "other" / "step-2",
        "symlink": tmp_path / "root" / "ckjob" / "step-9",
        "the-job-dir": tmp_path / "root" / "ckjob",
    }[where]
    if where == "symlink":
        (tmp_path / "planted").mkdir()
        target.symlink_to(tmp_path / "planted")
    model, opt = make()
    with pytest.raises(CheckpointRefused, match="not under"):
        ckpt.load(point(target), model, opt)


def test_an_uncommitted_or_altered_checkpoint_is_refused(tmp_path: Path) -> None:
    ckpt, path = saved(tmp_path)
    model, opt = make()
    with pytest.raises(CheckpointRefused, match="no commit record"):
        ckpt.load(point(path), model, opt)
    commit(path, crc=1)
    with pytest.raises(CheckpointRefused, match="CRC32"):
        ckpt.load(point(path), model, opt)
    commit(path, job="someone-else")
    with pytest.raises(CheckpointRefused, match="commit record"):
        ckpt.load(point(path), model, opt)
    # The user's own code naming a path needs no record (a save without a coordinator).
    (path / COMMIT_FILE).unlink()
    assert ckpt.load(path, model, opt) == 2


def _dotted_payload(marker: Path) -> bytes:
    """A protocol-4 pickle that asks the DCP metadata module for ``os.system``: a name
    lookup that walks the module's own imports."""
    cmd = f"touch {marker}".encode()
    return (b"\x80\x04" + b"\x8c" + bytes([len(b"torch.distributed.checkpoint.metadata")])
            + b"torch.distributed.checkpoint.metadata" + b"\x8c\x09os.system\x93"
            + b"\x8c" + bytes([len(cmd)]) + cmd + b"\x85R.")


@pytest.mark.parametrize("kind", ["reduce", "dotted-name"])
def test_a_planted_metadata_pickle_does_not_run(tmp_path: Path, kind: str) -> None:
    ckpt, path = saved(tmp_path)
    marker = tmp_path / "pwned"
    (path / METADATA_FILE).write_bytes(pickle.dumps(Payload(marker)) if kind == "reduce"
                                       else _dotted_payload(marker))
    commit(path)  # even with a matching record: the unpickler admits DCP classes only
    model, opt = make()
    with pytest.raises(CheckpointRefused, match="references"):
        ckpt.load(point(path), model, opt)
    assert not marker.exists()
    with pytest.raises(CheckpointRefused):
        read_metadata(path)
    assert not marker.exists()


def test_a_crafted_value_inside_the_checkpoint_does_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"x": Payload(marker)}, buf)
    with pytest.raises(CheckpointRefused, match="not plain data"):
        from_blob(buf.getvalue())
    assert not marker.exists()

    # Through DCP: a checkpoint whose step value (a non-tensor DCP pickles) is the payload.
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    guard = offline_guard()
    model, opt = make()
    ckpt = Checkpointer(guard, tmp_path / "root")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp_save({"model": model_sd, "optim": optim_sd, "trainguard": {"step": Payload(marker)}},
             checkpoint_id=str(ckpt.path_for(3)), no_dist=True)
    assert not marker.exists()  # saving pickles, it does not run
    fresh, fresh_opt = make()
    with pytest.raises(CheckpointRefused, match="not plain data"):
        ckpt.load(ckpt.path_for(3), fresh, fresh_opt)
    assert not marker.exists()


def test_an_older_pickled_rng_state_is_skipped_not_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    assert restore_py_rng(pickle.dumps(Payload(marker))) is False
    assert not marker.exists()


def test_extra_that_would_be_refused_at_load_fails_the_save(tmp_path: Path) -> None:
    guard = offline_guard()
    model, opt = make()
    ckpt = Checkpointer(guard, tmp_path)
    ckpt.save(4, model, opt, extra={"x": Payload(tmp_path / "pwned")})
    ckpt.wait()
    report = ckpt.reports[-1]
    assert report.step == 4 and not report.ok and "not plain data" in report.error


def test_python_and_numpy_rng_round_trip_without_pickle() -> None:
    import random

    import numpy as np

    random.seed(5)
    np.random.seed(6)
    blob = encode_py_rng()
    assert b"\x80" not in blob[:2]  # JSON, not a pickle
    expected = (random.random(), float(np.random.rand()))
    random.seed(0)
    np.random.seed(0)
    restore_py_rng(blob)
    assert (random.random(), float(np.random.rand())) == expected
    with pytest.raises(CheckpointRefused):
        restore_py_rng(b'{"py": 3}')


def test_confine_accepts_the_jobs_steps(tmp_path: Path) -> None:
    step = tmp_path / "j" / "step-1"
    step.mkdir(parents=True)
    assert confine(step, tmp_path, "j") == step.resolve()
    assert os.path.isdir(confine(str(step), str(tmp_path), "j"))


def test_an_untrained_model_still_loads_trusted_optimizer_values(tmp_path: Path) -> None:
    # Optimizer param groups (floats, tuples, bools) are non-tensor DCP values: they must
    # pass the weights_only check.
    ckpt, path = saved(tmp_path)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.8, 0.9), amsgrad=False)
    ckpt.load(path, model, opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2)
