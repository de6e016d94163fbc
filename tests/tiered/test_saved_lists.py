"""A list that grew since the save (a trainer's log history) restores from the persistent tier as
from the local tier: a fresh job's empty list takes the saved items."""

from __future__ import annotations

import time
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


def _both_tiers(root: Path, shm: Path, saved: Any, template: Any) -> dict[str, Any]:
    """``saved`` under ``"x"`` (a plain value of the state, not a stateful holder) saved to both
    tiers, then restored into ``template`` from each; the restored values by tier."""
    kwargs = {"local_every": 1, "persistent_every": 1}
    state = make_state(0) | {"x": saved, "after": 1}
    with TieredCheckpointManager(str(shm), str(root), "p", **kwargs) as manager:
        train_step(state, 1)
        manager.maybe_save(1, state)
    out = {}
    for local in (str(shm), None):
        restored = make_state(0) | {"x": template(), "after": 0}
        with TieredCheckpointManager(local, str(root), "p", **kwargs) as manager:
            assert manager.restore(restored) == 1
            out[manager.last_restore.tier] = restored["x"]
        assert restored["after"] == 1
    return out


@pytest.mark.parametrize(
    ("saved", "template"),
    [
        ([{"a.b": 1}], lambda: [{"a.b": 0}]),
        ([{"a": 1, "meta": {}}], lambda: [{"a": 0, "meta": {}}]),
        ([{"a": 1}, {}], lambda: [{"a": 0}, {}]),
        ([{True: 1, -1: 2}], lambda: [{True: 0, -1: 0}]),
        ([{"a.b": 1}, {"a": 2}], lambda: [{"a.b": 0}]),
    ],
    ids=["dotted key", "empty dict", "empty item", "other key types", "grown"],
)
def test_items_the_template_holds_as_saved_keep_what_names_cannot_tell(
    tmp_path, shm_dir, saved, template
):
    """torch DCP's names cannot tell a key "a.b" from a, b, nor show an empty dict or a key's
    type: an item of the template holding the saved names is loaded into. Before: every item was
    made anew from the names, so the restore raised KeyError after restoring part of the state
    ("a.b", "meta", True) or dropped the empty item."""
    restored = _both_tiers(tmp_path, shm_dir, saved, template)
    assert restored == {"local": saved, "persistent": saved}
    assert [list(map(type, item)) for item in restored["persistent"]] == [
        list(map(type, item)) for item in saved
    ]


@pytest.mark.parametrize(
    ("saved", "template"),
    [
        ([{"step": 1, "loss": 0.5}], lambda: [{"step": 0}]),
        ([{"step": 1}], lambda: [{"step": 0, "eval": 0.0}]),
        ([{"step": 1, "loss": 0.5}], lambda: [0.0]),
    ],
    ids=["more keys", "fewer keys", "a number"],
)
def test_a_list_item_saved_with_other_keys_than_the_template_restores_as_saved(
    tmp_path, shm_dir, saved, template
):
    """The list is plain data, not a stateful holder's: the restored values go into the live
    item. Before: its keys only were filled (the saved "loss" dropped), and a key the saved item
    lacks raised KeyError once part of the state was restored."""
    restored = _both_tiers(tmp_path, shm_dir, saved, template)
    assert restored == {"local": saved, "persistent": saved}
    assert [list(item) for item in restored["persistent"]] == [list(item) for item in saved]


@pytest.mark.parametrize(
    ("saved", "template"),
    [
        ([torch.full((2,), 3.0)], lambda: [0.0, 1.0]),
        ([torch.full((2,), 3.0), torch.full((1,), 4.0)], lambda: [0.0]),
        ([{"step": 1, "loss": torch.full((2,), 0.5)}], lambda: [{"step": 0, "loss": 0.0}] * 2),
    ],
    ids=["numbers", "shorter", "dicts of numbers"],
)
def test_a_list_of_plain_data_takes_a_saved_list_holding_tensors_from_either_tier(
    tmp_path, shm_dir, saved, template
):
    """A live list of plain data (a log that grew) where the saved list held tensors takes the
    saved items from either tier. Before: the local tier did, the persistent tier refused the
    restore ("x.0: float in the state, a tensor in the checkpoint", or "not in the checkpoint")."""
    restored = _both_tiers(tmp_path, shm_dir, saved, template)
    assert {tier: _as_lists(v) for tier, v in restored.items()} == dict.fromkeys(
        ("local", "persistent"), _as_lists(saved)
    )


def _as_lists(value: Any) -> Any:
    """``value`` with each tensor as ``("tensor", dtype, values)``, comparable by ``==``."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.tolist())
    if isinstance(value, dict):
        return {k: _as_lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_lists(v) for v in value]
    return value


def test_a_long_log_is_sized_in_one_pass_over_the_names():
    """Before: every item scanned every name of the checkpoint (10,000 entries: 30 s)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from tierpoint.tiered.saved_lists import lists_as_saved

    keys = ("loss", "grad_norm", "learning_rate", "epoch", "step", "tag")
    stored = {f"log.{i}.{k}": BytesStorageMetadata() for i in range(10_000) for k in keys}
    cpu = time.thread_time()  # not wall time: tests run in parallel, the machine is loaded
    sized = lists_as_saved({"log": []}, stored)
    assert time.thread_time() - cpu < 5
    assert len(sized["log"]) == 10_000 and list(sized["log"][-1]) == list(keys)
