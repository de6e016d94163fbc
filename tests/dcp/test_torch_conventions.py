"""torch DCP's conventions, written the way its users write them: ``checkpoint_id=``, ``Stateful``
wrappers (torchtitan's ``ModelWrapper``), checkpoints written with ``ZStandard`` stream transforms,
and the "Checkpoint already exists" refusal."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

import tierpoint.dcp as dcp
from tierpoint.errors import CheckpointingError, CorruptCheckpointError

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class ModelWrapper(Stateful):
    """torchtitan's model wrapper: several model parts behind one state dict."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts
        self.loaded = 0

    def state_dict(self) -> dict:
        return {k: v for part in self.parts for k, v in part.state_dict().items()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded += 1
        for part in self.parts:
            part.load_state_dict({k: state_dict[k] for k in part.state_dict()})


class TrainState(Stateful):
    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = int(state_dict["step"])


def _model(seed: int) -> ModelWrapper:
    torch.manual_seed(seed)
    return ModelWrapper([nn.Linear(4, 3), nn.Sequential(nn.Linear(3, 2))])


def test_checkpoint_id_and_stateful_wrappers_save_and_load_as_in_torch(tmp_path):
    path = str(tmp_path / "step-1")
    model, train = _model(0), TrainState(5)
    dcp.save({"model": model, "train_state": train}, checkpoint_id=path)

    # Saved through state_dict(): plain tensors under the wrapper's keys, nothing pickled whole.
    metadata = dcp.read_metadata(checkpoint_id=path)
    assert sorted(metadata.state_dict_metadata) == [
        "model.0.bias",
        "model.0.weight",
        "model.bias",
        "model.weight",
        "train_state.step",
    ]
    # ... and loaded back through load_state_dict(), by tierpoint and by plain torch.
    fresh, state = _model(1), TrainState()
    dcp.load({"model": fresh, "train_state": state}, checkpoint_id=path)
    assert fresh.loaded == 1 and state.step == 5
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    other = _model(2)
    torch_dcp.load({"model": other}, storage_reader=dcp.Reader(checkpoint_id=path))
    assert torch.equal(other.parts[0].weight, model.parts[0].weight)

    # torch's own save through tierpoint's Writer, named the torch way.
    path2 = str(tmp_path / "step-2")
    torch_dcp.save({"model": model}, storage_writer=dcp.Writer(checkpoint_id=path2))
    assert dcp.read_metadata(path2).state_dict_metadata["model.weight"].size == (3, 4)

    with pytest.raises(TypeError, match="checkpoint location twice"):
        dcp.save({"model": model}, path, checkpoint_id=path2)
    with pytest.raises(TypeError, match="checkpoint location twice"):
        dcp.Reader(path, checkpoint_id=path)


def test_async_save_takes_checkpoint_id_and_stateful_values(tmp_path):
    path = str(tmp_path / "step-3")
    model, train = _model(3), TrainState(9)
    future = dcp.async_save({"model": model, "train_state": train}, checkpoint_id=path)
    assert future.result(timeout=60) == path
    fresh, state = _model(4), TrainState()
    dcp.load({"model": fresh, "train_state": state}, checkpoint_id=path)
    assert state.step == 9 and torch.equal(fresh.parts[1][0].weight, model.parts[1][0].weight)


def test_a_checkpoint_written_with_zstd_by_plain_torch_is_read(tmp_path):
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    state = {
        "w": torch.arange(6000, dtype=torch.float32).reshape(60, 100),
        "b": torch.zeros(3, dtype=torch.bfloat16),
        "meta": {"lr": 0.1, "names": ["a", "b"]},
    }
    writer = torch_dcp.FileSystemWriter(str(tmp_path), _extensions=[ZStandard()])
    torch_dcp.save(state, storage_writer=writer)
    descriptors = {
        tuple(info.transform_descriptors or ())
        for info in dcp.read_metadata(tmp_path).storage_data.values()
    }
    assert descriptors == {("stream.zstd/1",)}

    target = {
        "w": torch.empty(60, 100),
        "b": torch.ones(3, dtype=torch.bfloat16),
        "meta": {"lr": 0.0, "names": []},
    }
    dcp.load(target, checkpoint_id=tmp_path)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert target["meta"] == {"lr": 0.1, "names": ["a", "b"]}

    # A damaged compressed stream is corrupt, and nothing is written into the state.
    (data_file,) = tmp_path.glob("*.distcp")
    raw = bytearray(data_file.read_bytes())
    raw[100:400] = bytes(300)
    data_file.write_bytes(bytes(raw))
    target["w"].zero_()
    with pytest.raises(CorruptCheckpointError):
        dcp.load(target, checkpoint_id=tmp_path)
    assert not target["w"].any()


def test_saving_into_a_committed_checkpoint_says_checkpoint_already_exists(tmp_path):
    path = tmp_path / "step-1"
    dcp.save({"x": torch.ones(4)}, checkpoint_id=path)
    with pytest.raises(CheckpointingError, match="Checkpoint already exists") as err:
        dcp.save({"x": torch.zeros(4)}, checkpoint_id=path)
    assert isinstance(err.value, RuntimeError)  # what torch raises, for `except RuntimeError`
    target = {"x": torch.zeros(4)}
    dcp.load(target, checkpoint_id=path)
    assert torch.equal(target["x"], torch.ones(4))  # the refused save lost nothing
    dcp.save({"x": torch.zeros(4)}, checkpoint_id=path, overwrite=True)


def _save_without_collectives_then_load(rank: int, world: int, path: str) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).reshape(6, 4)
    # torch writes __<rank>.metadata per rank and no .metadata
    torch_dcp.save(
        {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 9},
        checkpoint_id=path,
        use_collectives=False,
    )
    torch.distributed.barrier()
    target = {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]), "step": 0}
    dcp.load(target, checkpoint_id=path)
    # Sharded otherwise than saved, a rank's file holds half of its shard: torch would load that
    # half and leave the rest as it was, silently.
    other = {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)]), "step": 0}
    with pytest.raises(CheckpointingError, match="do not cover the part of 'w' this rank loads"):
        dcp.load(other, checkpoint_id=path)
    return [torch.equal(target["w"].full_tensor(), full), target["step"], other["step"]]


@pytest.mark.timeout(120)
def test_a_checkpoint_torch_saved_without_collectives_loads_at_its_world_size(tmp_path):
    """torch's ``dcp.save(..., use_collectives=False)`` writes rank-local ``__<rank>.metadata``
    files, which torch's ``dcp.load`` reads when there is no ``.metadata``: tierpoint's too (it
    said there was no committed checkpoint), and refuses a load that would leave part of a
    tensor unread."""
    from tierpoint.testing import run_ranks

    path = str(tmp_path / "no-collectives")
    assert run_ranks(_save_without_collectives_then_load, 2, path, timeout=90) == [[True, 9, 0]] * 2
