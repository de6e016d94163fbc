"""The tiered manager warms the local tier up at the first step it does not save: the first local
saves then fill spare files prepared in the background (2 ranks, each its own node, replicas on
the other, on /dev/shm), and what they saved restores bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

from tierpoint import TieredCheckpointManager
from tierpoint.testing import run_ranks

from .helpers import as_node, assert_same, fingerprint, make_state, train_step


def _manager(root: Path, node: int) -> TieredCheckpointManager:
    return TieredCheckpointManager(
        str(root / f"node{node}"), None, "job", local_every=5, keep_local=2, replication_factor=2
    )


def _train(rank: int, world: int, root: Path) -> dict:
    node = as_node(rank, ranks_per_node=1)
    state = make_state(rank)
    with _manager(root, node) as manager:
        directory = manager.local.local_ckpt_dir
        train_step(state, world)
        manager.maybe_save(1, state)  # not due: starts the warm-up
        manager.local.wait_for_warm_up()
        warm = {e.inode() for e in os.scandir(directory) if e.name.startswith("spare_")}
        for step in range(2, 11):
            train_step(state, world)
            manager.maybe_save(step, state)
        manager.wait()
        reference = fingerprint(state)
        parts = {e.name: e.inode() for e in os.scandir(directory) if e.name.startswith("iter")}
    state = make_state(rank)
    with _manager(root, node) as manager:
        step = manager.restore(state)
    assert_same(fingerprint(state), reference)
    return {
        "step": step,
        "warm": len(warm),
        "parts": len(parts),
        "filled": set(parts.values()) <= warm,
    }


def test_the_first_local_saves_fill_the_spares_prepared_at_the_first_step_not_saved(shm_dir):
    for out in run_ranks(_train, 2, shm_dir, timeout=200):
        # (keep_local + 1) own parts and as many replicas: the steady state, made ahead
        assert out["warm"] == 6
        # steps 5 and 10, own part and replica each: every file is a spare made ahead
        assert out == {"step": 10, "warm": 6, "parts": 4, "filled": True}


def _persistent_only(rank: int, world: int, root: Path) -> dict:
    state = make_state(rank, width=64)
    manager = TieredCheckpointManager(
        None, str(root / "persistent"), "job", local_every=0, persistent_every=4
    )
    with manager:
        pool = manager._staging_pool
        train_step(state, world)
        manager.maybe_save(1, state)  # not due: prepares the first save's staging memory
        pool.wait_for_spare(60)
        warmed = (pool.allocations, pool.bytes_held > 0)
        for step in range(2, 9):
            train_step(state, world)
            manager.maybe_save(step, state)
        manager.wait()
        reference = fingerprint(state)
        after = pool.allocations
    assert pool.bytes_held == 0  # closed with the manager
    restored = make_state(rank, width=64)
    with TieredCheckpointManager(None, str(root / "persistent"), "job", local_every=0) as again:
        step = again.restore(restored)
    assert_same(fingerprint(restored), reference)
    return {"warmed": warmed, "allocations after two saves": after, "step": step}


def test_a_persistent_only_manager_warms_up_the_staging_memory_of_its_first_save(tmp_path):
    for out in run_ranks(_persistent_only, 2, tmp_path, timeout=200):
        # one buffer, made ahead and taken by the first save, reused by the second
        assert out == {"warmed": (1, True), "allocations after two saves": 1, "step": 8}
