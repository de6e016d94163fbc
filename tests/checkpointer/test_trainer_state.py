"""Each rank's trainer state on 2 real ranks (gloo): bound to its save, not to the directory's name.

A checkpoint saved by 2 ranks loads under another name (a symlink, a copy) with each rank's own
trainer state; a trainer-state file of another save (another step's, or an earlier save into the
same directory) or of another rank is refused on every rank; a
rank whose file is missing gets an error naming it on every rank (never rank 0's state in its
place), and nothing is loaded. In the same processes: a damaged ``model_and_optim/.metadata`` is a
``CorruptCheckpointError`` on every rank.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

from tierpoint import Checkpointer
from tierpoint.errors import CheckpointingError
from tierpoint.testing import run_ranks

from .conftest import fresh_module, trained_module

CASES = {
    "latest": 2,  # a symlink to step2
    "step2-backup": 2,  # a copy of step2
    "other-save": 6,  # step6, with step4's rank 1 file in place of its own
    "ranks-swapped": 8,  # step8, its two files exchanged
    "rank1-missing": 10,  # step10, without rank 1's file
    "damaged": 12,  # step12, its model_and_optim/.metadata truncated
    "saved-again": 14,  # step14 saved twice, with rank 1's file of the first save put back
}
"""Each case, and the step it is made of."""


def _path(run: str, name: str) -> str:
    step = CASES[name]
    return f"{run}/{name}" if name in ("latest", "step2-backup") else f"{run}/step{step}"


def _damage(run: str) -> None:
    """Rank 0 makes each case of :data:`CASES` from the steps saved."""
    os.symlink(f"{run}/step2", _path(run, "latest"))
    shutil.copytree(f"{run}/step2", _path(run, "step2-backup"))
    shutil.copy(f"{run}/step4/train/rank1.safetensors", f"{_path(run, 'other-save')}/train/")
    train = f"{_path(run, 'ranks-swapped')}/train"
    os.rename(f"{train}/rank0.safetensors", f"{train}/tmp")
    os.rename(f"{train}/rank1.safetensors", f"{train}/rank0.safetensors")
    os.rename(f"{train}/tmp", f"{train}/rank1.safetensors")
    os.unlink(f"{_path(run, 'rank1-missing')}/train/rank1.safetensors")
    os.truncate(f"{_path(run, 'damaged')}/model_and_optim/.metadata", 500)


def _load_each_case(rank: int, world: int, run: str, work: str) -> dict[str, list]:
    checkpointer = Checkpointer(work_dir=work)
    for step in sorted({*CASES.values(), 4}):
        checkpointer.save(f"{run}/step{step}", trained_module(step), {"rank": rank, "step": step})
    if rank == 1:
        shutil.copy(f"{run}/step14/train/rank1.safetensors", f"{run}/first-save-rank1")
    again = Checkpointer(work_dir=work, save_overwrite=True)
    again.save(f"{run}/step14", trained_module(15), {"rank": rank, "step": 14, "again": True})
    if rank == 1:
        os.replace(f"{run}/first-save-rank1", f"{run}/step14/train/rank1.safetensors")
    if rank == 0:
        _damage(run)
    dist.barrier()
    outcomes = {}
    for name in CASES:
        target = fresh_module()
        before = target.model.weight.clone()
        try:
            outcome = ["loaded", checkpointer.load(_path(run, name), target)]
        except CheckpointingError as e:
            outcome = [type(e).__name__, str(e), torch.equal(target.model.weight, before)]
        outcomes[name] = outcome
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> tuple[str, list[dict[str, list]]]:
    """Each rank's outcome of loading each case (one run of 2 processes for the module)."""
    base = tmp_path_factory.mktemp("two-ranks")
    run = str(base / "run")
    return run, run_ranks(_load_each_case, 2, run, str(base / "work"), timeout=180)


def _refused_alike(outcomes: tuple[str, list[dict[str, list]]], name: str, file: str) -> str:
    """The message of the error every rank raised for case ``name``, checked: the same on every
    rank, a CorruptCheckpointError naming ``file`` of the case, nothing loaded."""
    run, results = outcomes
    seen = [by_case[name] for by_case in results]
    assert seen[0] == seen[1]  # the same error on every rank
    kind, message, untouched = seen[0]
    assert kind == "CorruptCheckpointError", message
    assert f"{_path(run, name)}/{file}" in message
    assert untouched  # nothing was loaded into the train module
    return message


def test_a_checkpoint_loads_under_another_name_with_each_ranks_own_state(outcomes):
    for rank, by_case in enumerate(outcomes[1]):
        for name in ("latest", "step2-backup"):  # a symlink, a copy
            assert by_case[name] == ["loaded", {"rank": rank, "step": 2}], name


def test_a_trainer_state_of_another_save_or_rank_is_refused(outcomes):
    message = _refused_alike(outcomes, "other-save", "train/rank1.safetensors")
    assert "swapped between ranks or saves" in message
    message = _refused_alike(outcomes, "ranks-swapped", "train/rank")
    assert "swapped between ranks or saves" in message


def test_a_trainer_state_of_an_earlier_save_into_the_same_directory_is_refused(outcomes):
    message = _refused_alike(outcomes, "saved-again", "train/rank1.safetensors")
    assert "swapped between ranks or saves" in message


def test_a_missing_trainer_state_file_is_an_error_on_every_rank(outcomes):
    message = _refused_alike(outcomes, "rank1-missing", "train/rank1.safetensors")
    assert "missing; its .metadata.json records a save by 2 ranks" in message


def test_a_damaged_dcp_metadata_is_a_corrupt_checkpoint_on_every_rank(outcomes):
    message = _refused_alike(outcomes, "damaged", "model_and_optim/.metadata")
    assert "not a DCP metadata pickle" in message


def _save_into_own_step(rank: int, world: int, run: str, work: str, apart: str) -> str:
    checkpointer = Checkpointer(work_dir=work)
    where = f"{run}/step{rank + 1}" if apart == "steps" else f"{run}/{'xy'[rank]}/step1"
    try:
        checkpointer.save(where, trained_module(1), {"rank": rank})
    except CheckpointingError as e:
        return str(e)
    return "saved"


@pytest.mark.parametrize("apart", ["steps", "parents"])
def test_ranks_saving_into_different_steps_are_refused_before_anything_is_written(tmp_path, apart):
    """Each rank's files would go to another directory and nothing would load (step1 and step2,
    or x/step1 and y/step1): every rank is told, and nothing is written."""
    run = tmp_path / "run"
    results = run_ranks(_save_into_own_step, 2, str(run), str(tmp_path / "work"), apart)
    assert all("every rank must save into the same step" in r for r in results), results
    first = f"{run}/step1" if apart == "steps" else f"{run}/x/step1"
    assert f"{first} on rank 0" in results[1]
    assert not run.exists() or not any(run.rglob("*.*"))


def test_trainer_state_files_are_as_readable_as_the_model_s(tmp_path):
    """On a shared run directory, whoever may read the model may read the trainer state: both
    get 0644 less the umask (the local tier's parts alone are private)."""
    umask = os.umask(0o022)
    try:
        Checkpointer(work_dir=str(tmp_path / "work")).save(
            str(tmp_path / "run" / "step1"), trained_module(1), {"step": 1}
        )
    finally:
        os.umask(umask)
    step = tmp_path / "run" / "step1"
    (model,) = [p for p in (step / "model_and_optim").iterdir() if p.suffix == ".distcp"][:1]
    assert (step / "train" / "rank0.safetensors").stat().st_mode & 0o777 == 0o644
    assert model.stat().st_mode & 0o777 == 0o644
