"""Values torch DCP would store pickled and the persistent tier's restore (``torch.load`` with
``weights_only=True``) would refuse (a dataclass config, an enum, a frozenset, a ``deque``) are
refused when the persistent save is made, naming where they are, rather than written into
checkpoints that no restore loads; the plain values such a restore loads still save."""

from __future__ import annotations

import collections
import dataclasses
import enum
from pathlib import Path
from typing import Any

import pytest
import torch

from tierpoint import RankLocal, TieredCheckpointManager

from .helpers import make_state, train_step


@dataclasses.dataclass
class Config:
    lr: float = 1e-3
    layers: int = 2


class Phase(enum.Enum):
    WARMUP = 1


def _save(root: Path, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Two persistent saves of ``state`` (no local tier); the persistent records."""
    events: list[dict[str, Any]] = []
    kwargs = {"local_every": 0, "persistent_every": 1, "on_event": events.append}
    with TieredCheckpointManager(None, str(root), "p", **kwargs) as manager:
        for step in (1, 2):
            train_step(state, 1)
            manager.maybe_save(step, state)
    return [e for e in events if e.get("tier") == "persistent" and "ok" in e]


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("config", Config(), "config (tests.tiered.test_pickled_values.Config)"),
        ("phase", {"now": Phase.WARMUP}, "phase.now (tests.tiered.test_pickled_values.Phase)"),
        ("seen", {"ids": frozenset({1, 2})}, "seen.ids (builtins.frozenset)"),
        ("window", RankLocal({"losses": collections.deque([1.0])}), "losses (collections.deque)"),
        ("pair", (1, (2, {3: range(4)})), "pair[1][1][3] (builtins.range)"),
    ],
)
def test_a_value_no_restore_could_load_is_refused_by_the_persistent_save(
    tmp_path, key, value, named
):
    state = make_state(0)
    state[key] = value
    records = _save(tmp_path, state)
    assert len(records) == 2 and not any(r["ok"] for r in records)
    assert named in records[0]["error"] and "pickled" in records[0]["error"]
    assert not list(tmp_path.glob("step-*/.metadata"))  # nothing that looks restorable
    with TieredCheckpointManager(None, str(tmp_path), "p", local_every=0) as manager:
        assert manager.restore(make_state(0) | {key: value}) is None


def test_plain_values_a_restore_loads_still_save_and_restore(tmp_path):
    """Those ``weights_only`` loads (sets, complex numbers, big ints, ``Counter``, torch sizes,
    dtypes and devices, tensors inside tuples) and any dict type at a level torch DCP flattens."""

    def values(seed: int) -> dict[str, Any]:
        return {
            "set": {seed, 2},
            "complex": complex(seed, 1),
            "big": 2**80 + seed,
            "counts": collections.Counter({"a": seed}),
            "meta": (torch.Size([seed]), torch.float16, torch.device("cpu"), bytearray(b"x")),
            "pair": (torch.full((2,), float(seed)), {"k": [seed, None]}),
            "by_word": collections.defaultdict(int, {"w": seed}),
        }

    state = make_state(0)
    state["extra"] = values(7)
    assert all(r["ok"] for r in _save(tmp_path, state))
    restored = make_state(0)
    restored["extra"] = values(0)
    with TieredCheckpointManager(None, str(tmp_path), "p", local_every=0) as manager:
        assert manager.restore(restored) == 2
    got, want = restored["extra"], values(7)
    assert torch.equal(got["pair"][0], want["pair"][0])
    assert {k: v for k, v in got.items() if k != "pair"} == {
        k: v for k, v in want.items() if k != "pair"
    }
    assert got["pair"][1] == want["pair"][1]


@dataclasses.dataclass
class RunConfig:
    """A config the user allows with ``torch.serialization.safe_globals``."""

    phase: Any = Phase.WARMUP
    out: Any = "runs/a"


def test_an_allowed_class_is_refused_when_it_holds_a_value_no_restore_could_load(tmp_path):
    """Before: an allowed class passed whatever it held, and its checkpoints failed every restore
    ("weights_only=True refused it")."""
    allowed = [RunConfig, Phase]
    with torch.serialization.safe_globals(allowed):
        state = make_state(0) | {"config": RunConfig(out=Path("runs/a"))}
        records = _save(tmp_path / "path", state)
        assert not any(r["ok"] for r in records)
        assert "config.out (pathlib." in records[0]["error"]
        state = make_state(0) | {"config": RunConfig()}
        assert all(r["ok"] for r in _save(tmp_path / "plain", state))
        restored = make_state(0) | {"config": RunConfig(phase=None, out=None)}
        with TieredCheckpointManager(None, str(tmp_path / "plain"), "p", local_every=0) as manager:
            assert manager.restore(restored) == 2
        assert restored["config"] == RunConfig()
