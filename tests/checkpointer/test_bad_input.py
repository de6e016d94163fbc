"""Bad input gets a clear error and loses nothing: a damaged ``.metadata.json`` (skipped by
discovery, refused by load), a step without ``model_and_optim``, a damaged DCP ``.metadata``, a
damaged trainer-state file, one of an older tierpoint (bound to its directory's name), a train
module that returns no dict. (Another world size: see test_training_script.py.)"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from tests.dcp.s3_server import faulty_endpoint, s3_bucket, s3_server  # noqa: F401 - fixtures
from tierpoint import Checkpointer, fileformat
from tierpoint.checkpointer import trainer_state
from tierpoint.errors import CheckpointingError, CorruptCheckpointError, StorageUnavailableError

from .conftest import fresh_module, trained_module


@pytest.fixture
def run(tmp_path, checkpointer) -> str:
    run = str(tmp_path / "run")
    checkpointer.save(f"{run}/step1", trained_module(0), {"step": 1})
    checkpointer.save(f"{run}/step2", trained_module(1), {"step": 2})
    return run


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"ephemeral": "yes"}', b""])
def test_a_damaged_metadata_json(run, checkpointer, content, caplog):
    with open(f"{run}/step2/.metadata.json", "wb") as f:
        f.write(content)
    with caplog.at_level(logging.WARNING, logger="tierpoint"):
        assert Checkpointer.latest_checkpoint(run) == f"{run}/step1"  # the older one is chosen
    assert "step2 is skipped" in caplog.text and ".metadata.json" in caplog.text
    target = fresh_module()
    before = target.model.weight.clone()
    with pytest.raises(CorruptCheckpointError, match=r"step2/\.metadata\.json"):
        checkpointer.load(f"{run}/step2", target)
    assert torch.equal(target.model.weight, before)
    assert checkpointer.load(Checkpointer.latest_checkpoint(run), target) == {"step": 1}


def test_a_step_the_store_cannot_serve_is_not_passed_over_for_an_older_one(
    s3_bucket,  # noqa: F811
    faulty_endpoint,  # noqa: F811
    tmp_path,
):
    """The store lists step2 but does not serve it: "the latest" must not become step1 (a resumed
    run would redo the steps since and save over step2), it raises; once served, step2 is latest."""
    base, options = s3_bucket
    saver = Checkpointer(work_dir=tmp_path / "work", storage_options=options)
    saver.save(f"{base}/run/step1", trained_module(0), {"step": 1})
    saver.save(f"{base}/run/step2", trained_module(1), {"step": 2})
    endpoint = faulty_endpoint(failing_reads="/run/step2")
    with pytest.raises(StorageUnavailableError, match="step2"):
        Checkpointer.latest_checkpoint(f"{base}/run", {"endpoint_url": endpoint.url})
    assert Checkpointer.latest_checkpoint(f"{base}/run", options) == f"{base}/run/step2"


def test_a_step_without_model_and_optim(run, checkpointer):
    shutil.rmtree(f"{run}/step2/model_and_optim")
    assert Checkpointer.latest_checkpoint(run) == f"{run}/step1"
    target = fresh_module()
    before = target.model.weight.clone()
    with pytest.raises(FileNotFoundError, match="model_and_optim/.metadata"):
        checkpointer.load(f"{run}/step2", target)
    assert torch.equal(target.model.weight, before)


def test_a_step_without_metadata_json_is_not_loaded(run, checkpointer):
    os.unlink(f"{run}/step2/.metadata.json")  # the save never finished
    with pytest.raises(FileNotFoundError, match="did not finish"):
        checkpointer.load(f"{run}/step2", fresh_module())


def test_a_damaged_trainer_state_file(run, checkpointer):
    path = f"{run}/step2/train/rank0.safetensors"
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    target = fresh_module()
    before = target.model.weight.clone()
    with pytest.raises(CorruptCheckpointError, match="rank0.safetensors"):
        checkpointer.load(f"{run}/step2", target)
    assert torch.equal(target.model.weight, before)


def test_a_damaged_dcp_metadata_is_a_corrupt_checkpoint(run, checkpointer):
    os.truncate(f"{run}/step2/model_and_optim/.metadata", 500)
    target = fresh_module()
    before = target.model.weight.clone()
    with pytest.raises(CorruptCheckpointError, match=r"step2/model_and_optim/\.metadata"):
        checkpointer.load(f"{run}/step2", target)
    assert torch.equal(target.model.weight, before)


def test_a_checkpoint_of_an_older_tierpoint_loads_where_its_name_agrees(run, checkpointer):
    """Trainer-state files written before save ids record their step directory's name."""
    step = f"{run}/step2"
    flat = trainer_state.encode({"step": 2})
    fileformat.write_flat(
        f"{step}/train/rank0.safetensors", flat, extra={"step_dir": "step2", "rank": 0}
    )
    meta = json.loads(open(f"{step}/.metadata.json").read())
    assert meta.pop("save_id")  # what the files of this version are bound to
    open(f"{step}/.metadata.json", "w").write(json.dumps(meta))
    assert checkpointer.load(step, fresh_module()) == {"step": 2}
    os.symlink(step, f"{run}/latest")
    with pytest.raises(CorruptCheckpointError, match="rank0.safetensors.*'step_dir': 'step2'"):
        checkpointer.load(f"{run}/latest", fresh_module())
    # A file of a newer save copied into it is refused: it records no step directory.
    shutil.copy(f"{run}/step1/train/rank0.safetensors", f"{step}/train/rank0.safetensors")
    with pytest.raises(CorruptCheckpointError, match="rank0.safetensors.*save_id"):
        checkpointer.load(step, fresh_module())


def test_a_train_module_that_returns_no_dict(tmp_path, checkpointer):
    class Broken:
        def state_dict_to_save(self):
            return [1, 2]

    with pytest.raises(CheckpointingError, match="state_dict_to_save.. returned a list"):
        checkpointer.save(f"{tmp_path}/run/step1", Broken(), {})
    assert not os.path.exists(f"{tmp_path}/run/step1")


def test_flags_given_as_strings_are_refused(tmp_path, run, checkpointer):
    """``allow_pickled_trainer_state="no"`` (a config string) would have read pickles."""
    with pytest.raises(CheckpointingError, match="allow_pickled_trainer_state must be True or"):
        Checkpointer(work_dir=tmp_path / "w1", allow_pickled_trainer_state="no")
    with pytest.raises(CheckpointingError, match="save_overwrite must be True or False"):
        Checkpointer(work_dir=tmp_path / "w2", save_overwrite="false")
    assert not (tmp_path / "w1").exists() and not (tmp_path / "w2").exists()
    with pytest.raises(CheckpointingError, match="allow_pickled_trainer_state must be True or"):
        checkpointer.load(f"{run}/step2", fresh_module(), allow_pickled_trainer_state="no")
