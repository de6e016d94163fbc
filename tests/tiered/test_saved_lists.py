"""A list that grew since the save (a trainer's log history) restores from the persistent tier as
from the local tier: a fresh job's empty list takes the saved items."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tierpoint import TieredCheckpointManager
from tierpoint.errors import StateMismatchError

from .helpers import assert_same, fingerprint, make_state, train_step


class TrainerState:
    """Like Hugging Face's ``TrainerState``: a log of dicts that grows every few steps."""

    def __init__(self) -> None:
        self.log_history: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"log_history": self.log_history}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.log_history = sd["log_history"]


def _state(rank: int = 0) -> dict[str, Any]:
    state = make_state(rank)
    state["trainer"] = TrainerState()
    state["losses"] = []  # plain floats: torch DCP stores the list as one value
    state["evals"] = []  # dicts holding tensors: stored item by item
    return state


def _train(state: dict[str, Any], step: int) -> None:
    train_step(state, 1)
    state["trainer"].log_history.append({"step": step, "loss": 1.0 / step, "tag": f"s{step}"})
    state["losses"].append(0.5 * step)
    state["evals"].append({"step": step, "scores": torch.full((2,), float(step))})


def _saved(base: Path, **kwargs: Any) -> dict[str, Any]:
    state = _state()
    with TieredCheckpointManager(None, str(base), "p", **kwargs) as manager:
        for step in range(1, 5):
            _train(state, step)
            manager.maybe_save(step, state)
    return state


def _same_values(restored: dict[str, Any], saved: dict[str, Any]) -> None:
    assert_same(fingerprint(restored), fingerprint(saved))
    assert restored["trainer"].log_history == saved["trainer"].log_history
    assert restored["losses"] == saved["losses"]
    assert [e["step"] for e in restored["evals"]] == [e["step"] for e in saved["evals"]]
    for got, want in zip(restored["evals"], saved["evals"], strict=True):
        assert torch.equal(got["scores"], want["scores"])


@pytest.mark.parametrize("template", ["fresh", "longer"])
def test_grown_lists_restore_from_the_persistent_tier(tmp_path, template):
    """Before: a fresh job's empty log refused the restore ("only in the checkpoint:
    trainer.log_history.0.loss"), so a job that lost its local tier could not resume."""
    kwargs = {"local_every": 0, "persistent_every": 2}
    saved = _saved(tmp_path, **kwargs)
    restored = _state()
    if template == "longer":  # lists holding more than was saved (no tensors): the saved win
        restored["trainer"].log_history = [{"step": i, "loss": 0.0} for i in range(6)]
        restored["losses"] = [0.0] * 6
    with TieredCheckpointManager(None, str(tmp_path), "p", **kwargs) as manager:
        assert manager.restore(restored) == 4
    _same_values(restored, saved)
    assert isinstance(restored["trainer"].log_history[0]["step"], int)


def test_the_local_tier_and_the_persistent_tier_restore_the_same_lists(tmp_path, shm_dir):
    kwargs = {"local_every": 2, "persistent_every": 2}
    local = str(shm_dir / "local")
    state = _state()
    with TieredCheckpointManager(local, str(tmp_path), "p", **kwargs) as manager:
        for step in range(1, 5):
            _train(state, step)
            manager.maybe_save(step, state)
    for local_root in (local, None):
        restored = _state()
        with TieredCheckpointManager(local_root, str(tmp_path), "p", **kwargs) as manager:
            assert manager.restore(restored) == 4
            assert manager.last_restore.tier == ("local" if local_root else "persistent")
        _same_values(restored, state)


@pytest.mark.parametrize(
    ("saved", "live"),
    [
        ([{0: torch.ones(1)}], []),  # {0: ...} and [...] have the same DCP names
        ([torch.ones(1)], [torch.ones(1), torch.ones(1)]),  # tensors: the layout changed
    ],
    ids=["int keys", "tensors"],
)
def test_lists_that_cannot_or_must_not_be_resized_are_refused_by_name(tmp_path, saved, live):
    kwargs = {"local_every": 0, "persistent_every": 1}
    state = make_state(0)
    state["items"] = saved
    with TieredCheckpointManager(None, str(tmp_path), "p", **kwargs) as manager:
        train_step(state, 1)
        manager.maybe_save(1, state)
    restored = make_state(0)
    restored["items"] = live
    with TieredCheckpointManager(None, str(tmp_path), "p", **kwargs) as manager:
        with pytest.raises(StateMismatchError, match="items"):
            manager.restore(restored)
