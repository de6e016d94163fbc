"""A closed manager keeps nothing of the local tier: no mapping, no descriptor of its part files
(a mapping pins its file's pages, RAM on /dev/shm, after the file is removed too), however many
managers a process made and closed one after another and still refers to."""

from __future__ import annotations

import os
from pathlib import Path

from tierpoint import TieredCheckpointManager
from tierpoint.testing import run_ranks

from .helpers import as_node, make_state, train_step


def _held(root: Path) -> list[str]:
    """What this process maps or holds open under ``root``: its mappings and descriptors."""
    prefix = str(root)
    with open("/proc/self/maps") as maps:
        held = [line.split(maxsplit=5)[-1].strip() for line in maps if prefix in line]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir used, closed meanwhile
            continue
        if target.startswith(prefix):
            held.append(target)
    return held


def _closed_one_after_another(rank: int, world: int, root: Path) -> list[list[str]]:
    as_node(rank, 1)  # a node per rank: each part is replicated on the other
    state, closed, held, step = make_state(rank, width=64), [], [], 0
    for _ in range(3):
        manager = TieredCheckpointManager(
            str(root / "local"), None, "job", local_every=1, keep_local=1
        )
        for _ in range(3):
            step += 1
            train_step(state, world)
            manager.maybe_save(step, state)
        manager.close()
        closed.append(manager)  # still referred to (for its stats, say)
        held.append(_held(root))
    return held


def test_closed_managers_keep_no_mapping_of_the_local_tier(shm_dir):
    for held in run_ranks(_closed_one_after_another, 2, shm_dir, timeout=180):
        assert held == [[], [], []]
