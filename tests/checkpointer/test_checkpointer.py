"""Each Checkpointer method and argument, in one process: the layout a save leaves, discovery,
save_overwrite, write_file, load's options, ephemeral checkpoints, the config and its fields."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import safetensors
import torch

from tierpoint import BasicTrainModule, Checkpointer, CheckpointerConfig, TrainModule
from tierpoint.errors import CheckpointingError, UnsupportedStateError

from .conftest import fresh_module, trained_module


def _run(tmp_path) -> str:
    return str(tmp_path / "run")


def test_a_save_leaves_olmo_cores_layout_with_pickle_free_trainer_state(tmp_path, checkpointer):
    step = f"{_run(tmp_path)}/{Checkpointer.checkpoint_dirname(3)}"
    checkpointer.save(step, trained_module(), {"step": 3, "rng": torch.arange(4)})
    assert sorted(os.listdir(step)) == [".metadata.json", "model_and_optim", "train"]
    assert os.listdir(f"{step}/train") == ["rank0.safetensors"]
    assert ".metadata" in os.listdir(f"{step}/model_and_optim")
    meta = json.loads(open(f"{step}/.metadata.json").read())
    assert meta["ephemeral"] is False and meta["world_size"] == 1
    with safetensors.safe_open(f"{step}/train/rank0.safetensors", "pt") as f:  # no pickle in it
        assert [torch.equal(f.get_tensor(k), torch.arange(4)) for k in f.keys()] == [True]
    assert Checkpointer.dir_is_checkpoint(step) and isinstance(fresh_module(), TrainModule)


def test_load_restores_model_optimizer_scheduler_and_trainer_state(tmp_path, checkpointer):
    saved = trained_module()
    checkpointer.save(f"{_run(tmp_path)}/step1", saved, {"step": 1, "name": "run-a"})
    target = fresh_module()
    state = checkpointer.load(f"{_run(tmp_path)}/step1", target)
    assert state == {"step": 1, "name": "run-a"}
    assert torch.equal(target.model.weight, saved.model.weight)
    exp_avg = target.optim.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, saved.optim.state_dict()["state"][0]["exp_avg"])
    assert target.scheduler.state_dict() == saved.scheduler.state_dict()


def test_load_options(tmp_path, checkpointer):
    saved = trained_module()
    path = f"{_run(tmp_path)}/step1"
    checkpointer.save(path, saved, {"step": 1})
    target = fresh_module()
    assert checkpointer.load(path, target, load_trainer_state=False, load_optim_state=False) is None
    assert torch.equal(target.model.weight, saved.model.weight)
    assert target.optim.state_dict()["state"] == {}  # model only: the optimizer was not touched
    assert target.scheduler.last_epoch == 0
    # A bare DCP checkpoint of weights (no trainer state): load_trainer_state=True needs one.
    weights = f"{_run(tmp_path)}/weights"
    from tierpoint import dcp

    dcp.save({"model": saved.model.state_dict()}, weights)
    assert Checkpointer.dir_is_checkpoint(weights)
    with pytest.raises(FileNotFoundError, match="Missing trainer state"):
        checkpointer.load(weights, fresh_module(), load_trainer_state=True)
    target = BasicTrainModule(torch.nn.Linear(6, 3))
    assert checkpointer.load(weights, target) is None
    assert torch.equal(target.model.bias, saved.model.bias)
    with pytest.raises(CheckpointingError, match="no optimizer state"):
        checkpointer.load(weights, fresh_module(), load_optim_state=True)


def test_find_latest_and_contains(tmp_path, checkpointer):
    run = _run(tmp_path)
    missing = f"{tmp_path}/no-such-run"  # OLMo-core's listing raises here too
    with pytest.raises(FileNotFoundError, match="No such directory"):
        list(Checkpointer.find_checkpoints(missing))
    with pytest.raises(FileNotFoundError, match="No checkpoints found") as raised:
        Checkpointer.latest_checkpoint(missing)
    assert str(raised.value).count("no-such-run") == 1, raised.value  # the path named once
    assert not Checkpointer.contains_checkpoint(missing)
    with pytest.raises(FileNotFoundError, match="No checkpoints found"):
        Checkpointer.latest_checkpoint(run)
    assert not Checkpointer.contains_checkpoint(run)
    module = trained_module()
    for step in (2, 9, 10):
        checkpointer.save(f"{run}/step{step}", module, {"step": step}, ephemeral=step == 9)
    os.makedirs(f"{run}/step11/train")  # an interrupted save: not a checkpoint
    os.makedirs(f"{run}/notes")
    found = list(Checkpointer.find_checkpoints(run))
    assert found == [(2, f"{run}/step2"), (10, f"{run}/step10")]  # 9 was removed by step 10's save
    assert list(Checkpointer.find_checkpoints(run, ephemeral=False)) == found
    assert Checkpointer.latest_checkpoint(run) == f"{run}/step10"
    assert Checkpointer.contains_checkpoint(run) and Checkpointer.contains_checkpoint(
        f"{run}/step2"
    )
    assert not Checkpointer.dir_is_checkpoint(f"{run}/step11")
    checkpointer.save(f"{run}/step12", module, {}, ephemeral=True)
    assert list(Checkpointer.find_checkpoints(run, ephemeral=True)) == [(12, f"{run}/step12")]
    assert Checkpointer.latest_checkpoint(run) == f"{run}/step12"


def test_ephemeral_checkpoints_are_removed_by_the_next_save(tmp_path, checkpointer):
    run = _run(tmp_path)
    module = trained_module()
    checkpointer.save(f"{run}/step1", module, {}, ephemeral=True)
    checkpointer.save(f"{run}/step2", module, {}, ephemeral=True)
    assert sorted(os.listdir(run)) == ["step2"]
    # After a restart (a new Checkpointer), the next save still removes the older ephemeral one.
    restarted = Checkpointer(work_dir=tmp_path / "work")
    restarted.save(f"{run}/step3", module, {})
    assert sorted(os.listdir(run)) == ["step3"]


def test_save_overwrite(tmp_path, checkpointer):
    path = f"{_run(tmp_path)}/step1"
    checkpointer.save(path, trained_module(0), {"v": 1})
    with pytest.raises(FileExistsError, match="save_overwrite=True"):
        checkpointer.save(path, trained_module(1), {"v": 2})
    assert checkpointer.load(path, fresh_module()) == {"v": 1}  # untouched
    overwriting = Checkpointer(work_dir=tmp_path / "work", save_overwrite=True)
    overwriting.save(path, trained_module(1), {"v": 2})
    target = fresh_module()
    assert checkpointer.load(path, target) == {"v": 2}
    assert torch.equal(target.model.weight, trained_module(1).model.weight)
    # Files that are not a checkpoint's are never removed without save_overwrite.
    os.makedirs(f"{_run(tmp_path)}/step5")
    open(f"{_run(tmp_path)}/step5/notes.txt", "w").close()
    with pytest.raises(FileExistsError, match="notes.txt"):
        checkpointer.save(f"{_run(tmp_path)}/step5", trained_module(), {})
    assert os.listdir(f"{_run(tmp_path)}/step5") == ["notes.txt"]


def test_a_save_into_an_interrupted_one_replaces_it(tmp_path, checkpointer):
    path = f"{_run(tmp_path)}/step4"
    checkpointer.save(path, trained_module(0), {"v": 0})
    os.unlink(f"{path}/.metadata.json")  # as if the save had died just before its commit
    assert not Checkpointer.dir_is_checkpoint(path)
    checkpointer.save(path, trained_module(1), {"v": 1})
    assert checkpointer.load(path, fresh_module()) == {"v": 1}


def test_unsupported_trainer_state_fails_before_anything_is_touched(tmp_path):
    path = f"{_run(tmp_path)}/step1"
    checkpointer = Checkpointer(work_dir=tmp_path / "work", save_overwrite=True)
    checkpointer.save(path, trained_module(), {"v": 1})
    with pytest.raises(UnsupportedStateError, match=r"callback"):
        checkpointer.save(path, trained_module(), {"callback": lambda: None})
    assert checkpointer.load(path, fresh_module()) == {"v": 1}  # the old checkpoint is intact


def test_the_unsupported_value_error_advises_only_what_the_checkpointer_offers(tmp_path):
    checkpointer = Checkpointer(work_dir=tmp_path / "work")
    with pytest.raises(UnsupportedStateError) as refused:
        checkpointer.save(f"{_run(tmp_path)}/step1", trained_module(), {"obj": object()})
    message = str(refused.value)
    assert "obj: objects of type builtins.object cannot be stored without pickle" in message
    assert "convert it to plain data" in message and "no option for other objects" in message
    assert "allow_pickle" not in message  # Checkpointer.save has no such parameter


def test_write_file(tmp_path, checkpointer):
    run = _run(tmp_path)
    target = checkpointer.write_file(run, "config.json", '{"a": 1}')
    assert target == tmp_path / "run" / "config.json" and target.read_text() == '{"a": 1}'
    with pytest.raises(FileExistsError):
        checkpointer.write_file(run, "config.json", b"again")
    overwriting = Checkpointer(work_dir=tmp_path / "work", save_overwrite=True)
    assert overwriting.write_file(run, "sub/x.bin", b"\x00\x01").read_bytes() == b"\x00\x01"
    overwriting.write_file(run, "config.json", b"again")
    assert target.read_bytes() == b"again"


def test_config_and_fields(tmp_path):
    config = CheckpointerConfig(work_dir=str(tmp_path / "w"), save_thread_count=3)
    checkpointer = config.build(load_thread_count=1, pre_download=True, throttle_uploads=True)
    assert isinstance(checkpointer, Checkpointer) and (tmp_path / "w").is_dir()
    assert (checkpointer.save_thread_count, checkpointer.load_thread_count) == (3, 1)
    assert checkpointer.save_overwrite is False and checkpointer.pre_download is True
    path = f"{_run(tmp_path)}/step1"
    module = trained_module()
    checkpointer.save(path, module, {})
    data = [n for n in os.listdir(f"{path}/model_and_optim") if n.endswith(".distcp")]
    assert len(data) == 3  # save_thread_count files per rank
    target = fresh_module()
    checkpointer.load(path, target)
    assert torch.equal(target.model.weight, module.model.weight)
    with pytest.raises(ValueError, match="work_dir"):
        CheckpointerConfig().build()
    with pytest.raises(ValueError, match="save_thread_count"):
        Checkpointer(work_dir=tmp_path, save_thread_count=0)
    assert (
        Checkpointer.checkpoint_dirname(12) == "step12"
        and Checkpointer.CHECKPOINT_DIR == "step{step}"
    )
    with pytest.raises(ValueError):
        Checkpointer.checkpoint_dirname(-1)
    # A step counted by numpy (a data loader's, say) names the same directory; it raised.
    assert Checkpointer.checkpoint_dirname(np.int64(12)) == "step12"
    for bad in (True, 12.0, "12"):
        with pytest.raises(ValueError):
            Checkpointer.checkpoint_dirname(bad)
