"""Run directories OLMo-core itself wrote: ``step<N>/model_and_optim`` saved by plain
``torch.distributed.checkpoint.save``, ``train/rank<r>.pt`` by ``torch.save`` and a
``.metadata.json``. Found and loaded; the pickled trainer state only with the explicit opt-in, and
then through torch's weights_only allow-list plus numpy's arrays (OLMo-core's Trainer saves numpy's
RNG state): a hostile pickle is refused even so, as refused (not corrupt)."""

from __future__ import annotations

import io
import json
import os
import random
import re

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from tierpoint import Checkpointer
from tierpoint.errors import CheckpointingError, CorruptCheckpointError, UnsupportedStateError

from .conftest import fresh_module, trained_module

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TRAINER_STATE = {
    "global_step": 20,
    "global_train_tokens_seen": 81920,
    "data_loader": {"dataset_fingerprint": "abc", "epoch": 1, "batches_processed": 20},
    "rng": torch.get_rng_state(),
}


def olmo_core_step(run: str, step: int, module, trainer_state: object) -> str:
    """What OLMo-core's Checkpointer leaves for ``step`` (one rank)."""
    path = f"{run}/step{step}"
    torch_dcp.save(module.state_dict_to_save(), checkpoint_id=f"{path}/model_and_optim")
    os.makedirs(f"{path}/train")
    torch.save(trainer_state, f"{path}/train/rank0.pt")
    with open(f"{path}/.metadata.json", "w") as f:
        json.dump({"ephemeral": False, "version": "2.1.0"}, f)
    return path


def test_an_olmo_core_run_directory_is_found_and_loads(tmp_path):
    run = str(tmp_path / "run")
    saved = trained_module()
    path = olmo_core_step(run, 20, saved, TRAINER_STATE)
    checkpointer = Checkpointer(work_dir=tmp_path / "work")
    assert Checkpointer.latest_checkpoint(run) == path
    assert list(Checkpointer.find_checkpoints(run, ephemeral=False)) == [(20, path)]

    target = fresh_module()
    before = target.model.weight.clone()
    with pytest.raises(CheckpointingError, match="allow_pickled_trainer_state=True"):
        checkpointer.load(path, target)
    assert torch.equal(target.model.weight, before)  # refused before anything was loaded

    state = checkpointer.load(path, target, allow_pickled_trainer_state=True)
    assert (
        state.keys() == TRAINER_STATE.keys()
        and state["data_loader"] == TRAINER_STATE["data_loader"]
    )
    assert torch.equal(state["rng"], TRAINER_STATE["rng"])
    assert torch.equal(target.model.weight, saved.model.weight)
    assert target.scheduler.state_dict() == saved.scheduler.state_dict()

    weights_only = fresh_module()  # without trainer state, no opt-in is needed
    assert checkpointer.load(path, weights_only, load_trainer_state=False) is None
    assert torch.equal(weights_only.model.bias, saved.model.bias)

    # The opt-in as a field, as a Trainer that calls load() itself needs it.
    trusting = Checkpointer(work_dir=tmp_path / "work", allow_pickled_trainer_state=True)
    assert trusting.load(path, fresh_module())["global_step"] == 20


class Hostile:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_trainer_state_pickle_is_refused_even_with_the_opt_in(tmp_path):
    marker = tmp_path / "pwned"
    path = olmo_core_step(
        str(tmp_path / "run"), 5, trained_module(), {"step": Hostile(str(marker))}
    )
    target = fresh_module()
    before = target.model.weight.clone()
    checkpointer = Checkpointer(work_dir=tmp_path / "work")
    with pytest.raises(UnsupportedStateError) as refused:
        checkpointer.load(path, target, allow_pickled_trainer_state=True)
    assert not marker.exists()  # nothing the file named was called
    assert torch.equal(target.model.weight, before)
    # Refused, not damaged: the error names the file, what torch refused and the way to trust it,
    # without torch's colour codes or its advice to turn the allow-list off.
    message = str(refused.value)
    assert not isinstance(refused.value, CorruptCheckpointError)
    assert re.search(
        r"rank0\.pt: torch\.load\(weights_only=True\) refused .*GLOBAL posix\.system", message
    )
    assert "torch.serialization.add_safe_globals" in message
    assert "\x1b" not in message and "`weights_only` set to `False`" not in message


def olmo_core_rngs() -> dict:
    """The RNG states OLMo-core's Trainer saves in each rank's trainer state."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.random.get_rng_state(),
    }


@pytest.mark.parametrize("numpy_names", ["numpy 2", "numpy 1"])
def test_olmo_core_trainer_state_with_rng_states_loads_with_the_opt_in(tmp_path, numpy_names):
    run = str(tmp_path / "run")
    state = {"global_step": 20, "rngs": olmo_core_rngs(), "tokens": np.int64(81920)}
    path = olmo_core_step(run, 20, trained_module(), state)
    if numpy_names == "numpy 1":  # as numpy 1 names its globals (numpy.core), in torch's old format
        data = io.BytesIO()
        torch.save(state, data, _use_new_zipfile_serialization=False)
        old = data.getvalue().replace(b"numpy._core.", b"numpy.core.")
        assert b"numpy.core.multiarray" in old
        with open(f"{path}/train/rank0.pt", "wb") as f:
            f.write(old)
    checkpointer = Checkpointer(work_dir=tmp_path / "work")
    loaded = checkpointer.load(path, fresh_module(), allow_pickled_trainer_state=True)
    assert loaded["global_step"] == 20 and loaded["tokens"] == 81920
    assert loaded["rngs"]["python"] == state["rngs"]["python"]
    kind, keys, pos, has_gauss, gauss = loaded["rngs"]["numpy"]
    assert kind == "MT19937" and np.array_equal(keys, state["rngs"]["numpy"][1])
    assert (pos, has_gauss, gauss) == state["rngs"]["numpy"][2:]
    assert torch.equal(loaded["rngs"]["torch"], state["rngs"]["torch"])
    np.random.set_state(loaded["rngs"]["numpy"])  # usable as OLMo-core's Trainer uses it
    random.setstate(loaded["rngs"]["python"])
