"""numpy values in a state (``np.random.get_state()``, counters) go to the persistent tier as
tensors and come back as numpy of their dtype and shape, on every rank its own; numpy values that
are not numbers are refused there, naming where they are, and kept by the local tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from tierpoint import RankLocal, TieredCheckpointManager
from tierpoint.errors import CheckpointingError
from tierpoint.testing import run_ranks

from .helpers import make_state, replica_warnings, train_step


def _numpy_state(rank: int, seed: int) -> dict[str, Any]:
    state = make_state(rank)
    state["loader"] = RankLocal({"rng": np.random.RandomState(seed + rank).get_state()})
    state["stats"] = {
        "mean": np.arange(6, dtype=np.float32).reshape(2, 3) * (seed + 1),
        "big_endian": (np.arange(3) * (seed + 1)).astype(">i4"),
        "count": np.int64(seed),
        "scale": np.float64(seed / 4),
    }
    return state


def _next_random(state: dict[str, Any]) -> int:
    generator = np.random.RandomState()
    generator.set_state(state["loader"].value["rng"])
    return int(generator.randint(1 << 30))


def _save_then_restore(rank: int, world: int, root: Path, local_every: int) -> dict[str, Any]:
    """Steps 1-4 saved (persistent every 2: step 4 is the newest there), then a fresh state of
    other values restored from the persistent tier alone."""
    state = _numpy_state(rank, 7)
    kwargs = {"local_every": local_every, "persistent_every": 2, "replication_factor": 1}
    with TieredCheckpointManager(str(root / "local"), str(root / "persistent"), "n", **kwargs) as m:
        for step in range(1, 5):
            train_step(state, world)
            m.maybe_save(step, state)
    restored = _numpy_state(rank, 0)
    with TieredCheckpointManager(None, str(root / "persistent"), "n", **kwargs) as m:
        step = m.restore(restored)
    stats = restored["stats"]
    return {
        "step": step,
        "next_random": _next_random(restored),
        "expected_random": int(np.random.RandomState(7 + rank).randint(1 << 30)),
        "mean": stats["mean"].tolist(),
        "types": [type(stats[k]).__name__ for k in ("mean", "big_endian", "count", "scale")],
        "dtypes": [stats[k].dtype.str for k in ("mean", "big_endian", "count", "scale")],
        "values": [stats["big_endian"].tolist(), int(stats["count"]), float(stats["scale"])],
    }


def _expected(rank: int) -> dict[str, Any]:
    return {
        "step": 4,
        "next_random": int(np.random.RandomState(7 + rank).randint(1 << 30)),
        "expected_random": int(np.random.RandomState(7 + rank).randint(1 << 30)),
        "mean": (np.arange(6, dtype=np.float32).reshape(2, 3) * 8).tolist(),
        "types": ["ndarray", "ndarray", "int64", "float64"],
        "dtypes": ["<f4", ">i4", "<i8", "<f8"],
        "values": [[0, 8, 16], 7, 1.75],
    }


def test_numpy_values_round_trip_through_the_persistent_tier(tmp_path):
    """Saved from the state (no local tier) and restored as numpy, equal, of their dtypes."""
    assert _save_then_restore(0, 1, tmp_path, local_every=0) == _expected(0)


def test_numpy_values_round_trip_when_copied_from_the_local_part(tmp_path):
    """A step due for both tiers: its persistent copy is made from the local part's bytes."""
    assert _save_then_restore(0, 1, tmp_path, local_every=1) == _expected(0)


def test_each_rank_restores_its_own_numpy_random_state(tmp_path):
    results = run_ranks(_save_then_restore, 2, tmp_path, 1, timeout=120)
    assert results == [_expected(0), _expected(1)]


def test_a_plain_dcp_reader_sees_numpy_values_as_tensors(tmp_path):
    state = _numpy_state(0, 3)
    with TieredCheckpointManager(None, str(tmp_path), "n", persistent_every=1) as manager:
        manager.maybe_save(1, state)
    metadata = torch_dcp.FileSystemReader(str(tmp_path / "step-1")).read_metadata()
    entry = metadata.state_dict_metadata["stats.mean"]
    assert entry.properties.dtype == torch.float32 and list(entry.size) == [2, 3]


def test_numpy_values_that_are_not_numbers_are_refused_by_the_persistent_tier_only(tmp_path):
    """torch DCP would pickle them and no restore would load the checkpoint: the persistent save
    fails naming the value's path (training goes on); the local tier keeps them as they are."""
    events: list = []
    state = make_state(0)
    state["labels"] = RankLocal({"names": np.array(["cat", "dog"])})
    kwargs = {"local_every": 1, "persistent_every": 2, "replication_factor": 1}
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    with TieredCheckpointManager(
        str(local), str(persistent), "n", on_event=events.append, **kwargs
    ) as manager:
        for step in (1, 2, 3):
            train_step(state, 1)
            manager.maybe_save(step, state)
    failed = [e for e in events if e["tier"] == "persistent"]
    assert failed and not any(e["ok"] for e in failed)
    assert "not numbers (__rank_local__.0.labels.names)" in failed[0]["error"]
    assert not any((persistent / "step-2").glob(".metadata"))
    restored = make_state(0)
    restored["labels"] = RankLocal({"names": np.array(["", ""])})
    with TieredCheckpointManager(str(local), None, "n", **kwargs) as manager:
        assert manager.restore(restored) == 3
    assert restored["labels"].value["names"].tolist() == ["cat", "dog"]


def _save_one(root: Path, state: dict[str, Any]) -> None:
    with TieredCheckpointManager(None, str(root), "n", persistent_every=1) as manager:
        manager.maybe_save(1, state)


def _restore_one(root: Path, state: dict[str, Any]) -> int | None:
    with TieredCheckpointManager(None, str(root), "n", persistent_every=1) as manager:
        return manager.restore(state)


class _Loader:
    """A data position that starts as an int and becomes np.int64 once numpy sizes are added."""

    def __init__(self) -> None:
        self.position: Any = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def test_a_counter_that_became_numpy_restores_into_a_fresh_state_and_back(tmp_path):
    """numpy numbers are stored as Python numbers: a fresh job's int takes a saved np.int64, and
    a live np.int64 takes a saved int (as its own type)."""
    loader = _Loader()
    loader.position += np.array([4, 4])[0]
    _save_one(tmp_path / "a", {"w": torch.ones(2), "loader": loader})
    fresh = {"w": torch.zeros(2), "loader": _Loader()}
    assert _restore_one(tmp_path / "a", fresh) == 1 and fresh["loader"].position == 4
    _save_one(tmp_path / "b", {"w": torch.ones(2), "loader": _Loader()})
    assert _restore_one(tmp_path / "b", {"w": torch.zeros(2), "loader": loader}) == 1
    assert type(loader.position) is np.int64 and loader.position == 0


def test_numpy_values_are_replaced_by_the_saved_ones_whatever_their_shape_and_dtype(tmp_path):
    """Both tiers replace numpy values rather than copy into them: an array whose length or dtype
    changed since the save (a loader's index over a grown dataset), also inside a tuple, takes the
    saved one whole, as a plain torch DCP restore would; the same from either tier."""
    saved = {"w": torch.ones(2), "order": np.arange(5) * 2, "t": ("name", np.arange(3.0) + 0.5)}
    kwargs = {"local_every": 1, "persistent_every": 1, "replication_factor": 1}
    local, persistent = str(tmp_path / "local"), str(tmp_path / "persistent")
    with TieredCheckpointManager(local, persistent, "n", **kwargs) as manager:
        manager.maybe_save(1, saved)
    for local_dir, tier in ((local, "local"), (None, "persistent")):
        live = {
            "w": torch.zeros(2),
            "order": np.zeros(7, np.int32),
            "t": ("", np.zeros(4, np.float32)),
        }
        with TieredCheckpointManager(local_dir, persistent, "n", **kwargs) as manager:
            assert manager.restore(live) == 1 and manager.last_restore.tier == tier
        assert live["w"].tolist() == [1.0, 1.0]
        assert live["order"].dtype == np.int64 and live["order"].tolist() == [0, 2, 4, 6, 8]
        assert type(live["t"]) is tuple and live["t"][0] == "name"
        assert live["t"][1].dtype == np.float64 and live["t"][1].tolist() == [0.5, 1.5, 2.5]


def test_a_hostile_numpy_size_in_the_metadata_skips_the_step_with_its_reason(tmp_path):
    """The saved shape of a numpy value comes from ``.metadata``: one no memory can hold makes the
    step unloadable, named as such, not a crash."""
    import dataclasses
    import pickle

    _save_one(tmp_path, {"w": torch.ones(2), "order": np.arange(5)})
    path = tmp_path / "step-1" / ".metadata"
    metadata = torch_dcp.FileSystemReader(str(path.parent)).read_metadata()
    item, size = metadata.state_dict_metadata["order"], torch.Size([1 << 62])
    item.size, item.chunks = size, [dataclasses.replace(item.chunks[0], sizes=size)]
    del metadata.all_local_plans  # (its copy of the size would give the lie away first)
    path.write_bytes(pickle.dumps(metadata))
    live = {"w": torch.zeros(2), "order": np.zeros(5, np.int64)}
    with pytest.raises(
        CheckpointingError, match="allocating the numpy values of persistent step 1"
    ):
        _restore_one(tmp_path, live)
    assert live["w"].tolist() == [0.0, 0.0] and live["order"].tolist() == [0] * 5


def _numpy_float_per_rank(rank: int, world: int, root: Path) -> list[str]:
    return replica_warnings(
        lambda: _save_one(root, {"w": torch.ones(2), "ema": np.float64(rank + 0.5)})
    )


def test_a_numpy_number_that_differs_between_ranks_is_named(tmp_path):
    warned = run_ranks(_numpy_float_per_rank, 2, tmp_path, timeout=120)
    assert len(warned[0]) == 1 and "'ema'" in warned[0][0] and warned[1] == []


def test_a_resized_numpy_value_under_int_keys_restores_from_the_persistent_tier(tmp_path):
    """torch DCP names an int key 8 as "8": the saved array takes its place under the int key."""
    _save_one(tmp_path, {"w": torch.ones(2), "ints": {8: np.arange(1), 9: np.arange(2.0)}})
    live = {"w": torch.zeros(2), "ints": {8: np.arange(2), 9: np.zeros(5)}}
    assert _restore_one(tmp_path, live) == 1
    assert list(live["ints"]) == [8, 9] and live["ints"][8].tolist() == [0]
    assert live["ints"][9].tolist() == [0.0, 1.0]
