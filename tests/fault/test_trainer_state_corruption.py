"""Corruption fuzzing of the checkpointer's per-rank trainer state (``<step>/train/rank<r>.safetensors``,
:mod:`tierpoint.checkpointer.trainer_state`), in this process: 2 ranks' files at 2 steps.

Asserts: a bit flip, a truncation or appended bytes is detected when the file is read (a
:class:`CheckpointingError` naming it) or harmless (every value bit-equal), never silent. A file
swapped with another rank's or step's (each intact) is refused: each records the id of its save
(which the step's ``.metadata.json`` records too) and its rank.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tierpoint.checkpointer import trainer_state
from tierpoint.checkpointer.metadata import METADATA_FNAME, CheckpointMetadata

from . import corruptions as cx

SEEDS = range(40)


def _layout(base: Path) -> list[Path]:
    for step in (1, 2):
        step_dir = base / f"step-{step}"
        step_dir.mkdir()
        meta = CheckpointMetadata(world_size=2, save_id=f"save-{step}")
        (step_dir / METADATA_FNAME).write_bytes(meta.to_json())
        for rank in (0, 1):
            g = torch.Generator().manual_seed(step * 10 + rank)
            state = {
                "step": step,
                "rank": rank,
                "rng": torch.randint(0, 255, (64,), generator=g, dtype=torch.uint8),
                "loader": {"epoch": step, "position": torch.randn(8, generator=g)},
            }
            flat = trainer_state.encode(state)
            trainer_state.write(
                str(step_dir), rank, flat, save_id=f"save-{step}", work_dir=str(base)
            )
    files = cx.catalogue(base)
    assert [cx.kind_of(f) for f in files] == ["trainer"] * 4
    return files


def _trial(base: Path, files: list[Path], seed: int, mutations: tuple[str, ...]) -> tuple:
    m = cx.draw(seed, files, base, kinds=("trainer",), mutations=mutations)
    before = cx.read_values(base / m.target, base)
    undo = cx.apply(m, base)
    try:
        return m, *cx.inspect(m, base, before)
    finally:
        undo()


def test_damaged_trainer_state_is_detected(tmp_path: Path) -> None:
    files = _layout(tmp_path)
    outcomes = {}
    for seed in SEEDS:
        m, outcome, reason = _trial(tmp_path, files, seed, ("flip", "truncate", "append"))
        assert outcome != "silent", f"{m.describe()}: {reason}"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("detected", 0) >= len(SEEDS) // 2, outcomes


def test_a_trainer_state_swapped_between_ranks_or_steps_is_detected(tmp_path: Path) -> None:
    files = _layout(tmp_path)
    for seed in range(6):
        m, outcome, reason = _trial(tmp_path, files, seed, ("swap_rank", "swap_step"))
        assert outcome != "silent", f"{m.describe()}: {reason}"
