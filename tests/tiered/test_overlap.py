"""TieredCheckpointManager(overlap_snapshot=True): the snapshot copies in the background while
training goes on, the optimizers wait for it before their steps, and every saved step restores bit
for bit from both tiers (2 ranks, each its own node)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from tierpoint import CheckpointingError, TieredCheckpointManager
from tierpoint.testing import run_ranks

from .helpers import as_node, assert_same, fingerprint, make_state, train_step, wipe


def _manager(root: Path, node: int, device_snapshot: bool = False) -> TieredCheckpointManager:
    return TieredCheckpointManager(
        str(root / f"node{node}"),
        str(root / "persistent"),
        "job",
        local_every=3,
        persistent_every=6,
        overlap_snapshot=True,
        device_snapshot=device_snapshot,
    )


def _train_then_restore(rank: int, world: int, root: Path, device_snapshot: bool) -> dict:
    node = as_node(rank, ranks_per_node=1)
    state = make_state(rank, width=256)
    with _manager(root, node, device_snapshot) as manager:
        for step in range(1, 13):
            train_step(state, world)  # the optimizer's step waits for the snapshot in flight
            manager.maybe_save(step, state)
        reference = fingerprint(state)  # step 12: due for both tiers
        hooks = len(state["optimizer"]._optimizer_step_pre_hooks)
    out = {"hooks while open": hooks}
    out["hooks after close"] = len(state["optimizer"]._optimizer_step_pre_hooks)
    for tier in ("local", "persistent"):
        if tier == "persistent":
            dist.barrier()
            wipe(root / f"node{node}")
            dist.barrier()
        restored = make_state(rank, width=256)
        with _manager(root, node) as manager:
            out[tier] = (manager.restore(restored), manager.last_restore.tier)
        assert_same(fingerprint(restored), reference)
    return out


@pytest.mark.parametrize("device_snapshot", [False, True])
def test_overlapped_snapshots_restore_bit_for_bit_from_both_tiers(shm_dir, device_snapshot):
    """With ``device_snapshot`` the hooks wait for nothing: the state was copied in ``maybe_save``."""
    for out in run_ranks(_train_then_restore, 2, shm_dir, device_snapshot, timeout=240):
        assert out == {
            "hooks while open": 1,
            "hooks after close": 0,
            "local": (12, "local"),
            "persistent": (12, "persistent"),
        }


@pytest.mark.parametrize("name", ["overlap_snapshot", "device_snapshot"])
def test_the_snapshot_flags_must_be_bools(tmp_path, name):
    with pytest.raises(CheckpointingError, match=f"{name} must be True or False"):
        TieredCheckpointManager(str(tmp_path), None, **{name: "yes"})
