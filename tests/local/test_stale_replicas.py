"""Replicas left from another save of the same iteration: with three copies of each part, a node
that was away while the iteration was saved again comes back with the earlier save's copies. A rank
whose own part is damaged fetches it from a holder of the newest save, not from the stale one, the
node's own part of the earlier save is replaced too, and the load restores the newest save bit for
bit. 3 real gloo ranks, one simulated node each."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierpoint import fileformat
from tierpoint.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
)
from tierpoint.local.naming import part_name
from tierpoint.testing import run_ranks

from .helpers import WarningRecords, as_node, assert_bitwise_equal, flip_tensor_byte, make_state

WORLD = 3


def _manager(root: str) -> LocalCheckpointManager:
    strategy = CliqueReplicationStrategy(replication_factor=3)  # one clique: ranks 0, 1 and 2
    return LocalCheckpointManager(root, session_id="job", repl_strategy=strategy, keep_last=2)


def _saves_of(root: Path, iteration: int) -> set[str]:
    """The save tokens of every copy of ``iteration`` under ``root``."""
    return {
        str(
            fileformat.read_header(root / "job" / str(holder) / part_name(iteration, o)).extra[
                "save"
            ]
        )
        for holder in range(WORLD)
        for o in range(WORLD)
    }


def _node_back_with_an_earlier_save(
    rank: int, world: int, root: str, damaged: bool, old_tokens: bool = False
) -> tuple:
    """Run A saves 5 and 6; node 0 goes away with A's copies of 6; the job resumes from 5 (A's 6
    lost elsewhere) and saves its own 6 (run B); node 0 comes back with A's copies, and rank 1's
    own part of 6 is ``damaged``. ``old_tokens``: run A is a tierpoint of before time-ordered save
    tokens (16 random hex digits, here a high one). ``(loaded iteration, warnings, tokens of every
    copy of 6)``."""
    import torch.distributed as dist

    from tierpoint.local import agreement

    as_node(rank, 1)
    root_path = Path(root)
    mine = root_path / "job" / str(rank)
    manager = _manager(root)
    made, text = agreement._new_token, agreement._token_text
    if old_tokens:
        agreement._new_token = lambda: (1 << 62) - 1
        agreement._token_text = lambda value: f"{value:016x}"
    for it in (5, 6):  # run A
        manager.save(BasicTensorAwareStateDict(make_state(rank, it)), it)
    agreement._new_token, agreement._token_text = made, text
    away = {o: (mine / part_name(6, o)).read_bytes() for o in range(world)} if rank == 0 else {}
    dist.barrier()
    for o in range(world):  # run A's 6 is lost on every node (node 0 takes its copies away)
        (mine / part_name(6, o)).unlink()
    dist.barrier()
    manager = _manager(root)
    assert manager.find_latest() == 5
    manager.load()
    manager.wait_for_restore()
    manager.save(BasicTensorAwareStateDict(make_state(rank, 60)), 6)  # run B's 6
    dist.barrier()
    for o, data in away.items():  # node 0 is back with run A's own part and replicas of 6
        (mine / part_name(6, o)).write_bytes(data)
    if rank == 1 and damaged:
        flip_tensor_byte(mine / part_name(6, 1))
    dist.barrier()
    records = WarningRecords()
    manager = _manager(root)
    assert manager.find_latest() == 6
    ta, _ = manager.load()
    assert manager.last_load is not None
    iteration = manager.last_load.iteration
    assert_bitwise_equal(ta.state_dict, make_state(rank, 60 if iteration == 6 else iteration))
    manager.wait_for_restore()  # the stale copies are replaced in the background
    dist.barrier()
    return iteration, records.messages, _saves_of(root_path, 6)


@pytest.mark.parametrize("damaged", [True, False], ids=["own-part-damaged", "all-present"])
def test_a_stale_replica_of_another_save_is_not_fetched(tmp_path: Path, damaged: bool) -> None:
    """Damaged: holders of rank 1's part are rank 0 (run A's copy, stale) and rank 2 (run B's).
    All present: only rank 0's own part is run A's. The load restores run B's 6 on every rank, bit
    for bit, and every copy of 6 is run B's afterwards (before, damaged: it fetched rank 0's stale
    copy; both: it found the parts came from different saves and fell back to 5)."""
    results = run_ranks(_node_back_with_an_earlier_save, WORLD, str(tmp_path), damaged)
    assert [r[0] for r in results] == [6] * WORLD
    assert not any("different saves" in w for r in results for w in r[1])
    saves = results[0][2]
    assert len(saves) == 1, saves


def test_a_save_made_before_time_ordered_tokens_is_older_than_any_made_since(
    tmp_path: Path,
) -> None:
    """Run A's token is a random one of before (here above every time-ordered one): run B's 6
    is still the newest save. Before: run A's stale copies were taken as the newest save and
    replaced run B's parts on every rank, and the load returned run A's 6."""
    results = run_ranks(_node_back_with_an_earlier_save, WORLD, str(tmp_path), False, True)
    assert [r[0] for r in results] == [6] * WORLD  # and run B's values (checked in the ranks)
    assert len(results[0][2]) == 1, results[0][2]
