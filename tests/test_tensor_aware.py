"""BasicTensorAwareStateDict: NVRx-compatible names, no mutation of the caller's state."""

from __future__ import annotations

import pytest
import torch

from tierpoint import BasicTensorAwareStateDict, CheckpointingError, TensorAwareStateDict
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.errors import UnsupportedStateError
from tierpoint.local import LocalCheckpointManager
from tierpoint.tree import FlatState


def _state() -> dict:
    w = torch.randn(3, 4)
    return {"model": {"w": w, "tied": w, "b": torch.zeros(4)}, "step": 7, "opt": [torch.ones(2)]}


def test_pop_and_insert_leave_the_callers_state_untouched():
    state = _state()
    before = {k: v for k, v in state["model"].items()}
    ta = BasicTensorAwareStateDict(state)
    tensors = ta.pop_tensors()
    assert ta.is_hollow and len(tensors) == 3  # the tied tensor is stored once
    assert state["model"] == before and state["model"]["w"] is before["w"]
    with pytest.raises(CheckpointingError, match="hollow"):
        _ = ta.state_dict
    ta.insert_tensors(tensors)
    rebuilt = ta.state_dict
    assert rebuilt["model"]["w"] is state["model"]["w"]
    assert rebuilt["model"]["tied"] is rebuilt["model"]["w"]
    assert rebuilt["step"] == 7


def test_insert_checks_shapes_and_count():
    ta = BasicTensorAwareStateDict(_state())
    tensors = ta.pop_tensors()
    with pytest.raises(CheckpointingError, match="expected 3 tensors"):
        ta.insert_tensors(tensors[:2])
    with pytest.raises(CheckpointingError, match="model.w"):
        ta.insert_tensors([torch.zeros(5), *tensors[1:]])
    ta.insert_tensors(tensors)
    with pytest.raises(CheckpointingError, match="needs a hollow"):
        ta.insert_tensors(tensors)


def test_init_tensors_allocates_matching_shapes():
    ta = BasicTensorAwareStateDict(_state())
    originals = ta.pop_tensors()
    ta.init_tensors()
    assert [(t.shape, t.dtype) for t in ta.tensors] == [(t.shape, t.dtype) for t in originals]


def test_devices_are_remembered_per_tensor_and_missing_devices_fall_back_to_cpu(caplog):
    flat = FlatState({"~": "tensor", "i": 0}, [torch.ones(2)], ["x"])
    ta = BasicTensorAwareStateDict.from_flat(
        flat, ["cuda:7" if not torch.cuda.is_available() else "cpu"]
    )
    ta.copy_tensors_to_cpu()
    with caplog.at_level("INFO", logger="tierpoint"):
        ta.restore_tensor_device()
    assert ta.tensors[0].device.type == "cpu"
    if not torch.cuda.is_available():
        assert "does not exist here" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip():
    state = {"gpu": torch.randn(3, device="cuda"), "cpu": torch.randn(3)}
    ta = BasicTensorAwareStateDict(state)
    ta.copy_tensors_to_cpu()
    assert all(t.device.type == "cpu" for t in ta.tensors)
    ta.restore_tensor_device(non_blocking=False)
    assert ta.state_dict["gpu"].device.type == "cuda" and ta.state_dict["cpu"].device.type == "cpu"


def test_state_dict_is_the_wrapped_dict_and_changes_to_it_are_saved():
    """As with NVRx: ``ta.state_dict`` is the dict given (the same object every time), it can be
    assigned, and what is changed through it before a save is what the flattened form holds."""
    state = _state()
    ta = BasicTensorAwareStateDict(state)
    assert ta.state_dict is state and ta.state_dict is ta.state_dict
    state["step"] = 42  # changed after wrapping, through the caller's own reference
    ta.state_dict["extra"] = torch.arange(3)
    flat = ta.to_flat()
    assert "extra" in flat.paths and len(flat.tensors) == 4
    assert BasicTensorAwareStateDict.from_flat(flat).state_dict["step"] == 42
    ta.state_dict = {"only": torch.ones(2)}
    assert ta.to_flat().paths == ["only"]
    with pytest.raises(UnsupportedStateError, match="only.fn"):  # refused at once, not at save
        ta.state_dict = {"only": {"fn": object()}}


def test_a_loaded_state_dict_is_built_once():
    ta = BasicTensorAwareStateDict.from_flat(BasicTensorAwareStateDict(_state()).to_flat())
    first = ta.state_dict
    assert ta.state_dict is first
    first["step"] = 8
    assert BasicTensorAwareStateDict.from_flat(ta.to_flat()).state_dict["step"] == 8


class NVRxStyleStateDict(TensorAwareStateDict):
    """Written the way NVRx users write one: the seven NVRx abstract methods, nothing else."""

    def __init__(self, state_dict: dict) -> None:
        self._hollow_state = {k: v for k, v in state_dict.items() if not torch.is_tensor(v)}
        self._keys = [k for k, v in state_dict.items() if torch.is_tensor(v)]
        self._tensors = [state_dict[k] for k in self._keys]
        self._devices = [t.device for t in self._tensors]

    @property
    def tensors(self):
        return self._tensors

    @property
    def is_hollow(self):
        return self._tensors is None

    def pop_tensors(self):
        tensors, self._tensors = self._tensors, None
        return tensors

    def insert_tensors(self, tensor_data):
        self._tensors = list(tensor_data)

    def init_tensors(self):
        self._tensors = [torch.empty(0) for _ in self._keys]

    def copy_tensors_to_cpu(self, non_blocking=False):
        self._tensors = [t.to("cpu", non_blocking=non_blocking) for t in self._tensors]

    def restore_tensor_device(self, non_blocking=True):
        self._tensors = [t.to(d) for t, d in zip(self._tensors, self._devices)]


def test_an_nvrx_style_subclass_saves_and_loads_sync_and_async(tmp_path):
    state = {"w": torch.randn(4, 3), "b": torch.arange(5), "step": 3}
    ta = NVRxStyleStateDict(state)
    assert list(ta.values())  # NVRx's concrete helper
    manager = LocalCheckpointManager(tmp_path, session_id="nvrx")
    manager.save(ta, 1)
    loaded, _ = LocalCheckpointManager(tmp_path, session_id="nvrx").load()
    saved = loaded.state_dict  # the subclass's attributes, as NVRx pickles them
    assert saved["_keys"] == ["w", "b"] and saved["_hollow_state"] == {"step": 3}
    assert torch.equal(saved["_tensors"][0], state["w"])
    with AsyncCallsQueue() as queue:
        queue.schedule_async_request(manager.save(NVRxStyleStateDict(state), 2, is_async=True))
        queue.maybe_finalize_async_calls(blocking=True)
    assert manager.find_latest() == 2
    hollow = NVRxStyleStateDict(state)
    hollow.pop_tensors()
    with pytest.raises(CheckpointingError, match="hollow"):
        manager.save(hollow, 3)
    assert manager.find_latest() == 2
