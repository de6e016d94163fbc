"""Peer replication on 4 real gloo ranks, two simulated nodes (ranks 0-1 and 2-3).

Cliques with the default jump (2 ranks per node) and factor 2 are {0, 2} and {1, 3}: every part has a
copy on the other node.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.errors import CheckpointingError, SameMachineReplicationException
from tierpoint.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LazyCliqueReplicationStrategy,
    LocalCheckpointManager,
)
from tierpoint.local.naming import part_name
from tierpoint.local.retrieval import HolderStatus, plan_retrieval
from tierpoint.spawn import run_ranks

from .helpers import WarningRecords, assert_bitwise_equal, flip_tensor_byte, make_state

WORLD = 4


def _as_node(rank: int, ranks_per_node: int = 2) -> None:
    os.environ["TIERPOINT_NODE_ID"] = f"node{rank // ranks_per_node}"


def _manager(root: str, lazy: bool = False, **kwargs) -> LocalCheckpointManager:
    cls = LazyCliqueReplicationStrategy if lazy else CliqueReplicationStrategy
    strategy = cls.from_replication_params(replication_factor=2)
    return LocalCheckpointManager(root, session_id="job", repl_strategy=strategy, **kwargs)


def _files(root: Path, holder: int) -> list[str]:
    d = root / "job" / str(holder)
    return sorted(p for p in os.listdir(d) if p.startswith("iter_")) if d.is_dir() else []


# ------------------------------------------------------------------------------------ strategy


def _strategy_checks(rank: int, world: int) -> dict:
    """Everything about building strategies, on one set of 4 ranks (2 per simulated node)."""
    _as_node(rank)
    default = CliqueReplicationStrategy.from_replication_params(None, 2)
    jump_one = CliqueReplicationStrategy.from_replication_params(1, 2)  # warns: 0, 1 share node0
    records = WarningRecords()
    CliqueReplicationStrategy.from_replication_params(1, 2)
    with pytest.raises(SameMachineReplicationException, match="same node"):
        CliqueReplicationStrategy.from_replication_params(1, 2, strict=True)
    with pytest.raises(CheckpointingError) as bad:
        CliqueReplicationStrategy.from_replication_params(3, 2)
    return {
        "default": [default.clique(r) for r in range(world)],
        "jump_one": [jump_one.clique(r) for r in range(world)],
        "warnings": records.messages,
        "bad": str(bad.value),
    }


def test_strategy_cliques_parameters_and_node_check() -> None:
    result = run_ranks(_strategy_checks, WORLD)[0]
    # The default jump is the number of ranks per node: every clique spans both nodes.
    assert result["default"] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert result["jump_one"] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert any("same node" in m and "rank 0: node0" in m for m in result["warnings"])
    assert "world size 4" in result["bad"] and "3 * 2 = 6" in result["bad"]
    with pytest.raises(CheckpointingError, match="replication_factor.*0"):
        CliqueReplicationStrategy(1, 0)
    with pytest.raises(CheckpointingError, match="replication_jump.*-1"):
        CliqueReplicationStrategy.from_replication_params(-1, 2)
    assert issubclass(SameMachineReplicationException, CheckpointingError)


def test_retrieval_plan_spreads_sources_and_reports_losses() -> None:
    # 4 ranks, every rank holds every part except rank 3, which lost everything.
    statuses = [HolderStatus(True, [0, 1, 2, 3]) for _ in range(3)] + [HolderStatus(False, [])]
    plan = plan_retrieval(statuses, lambda o: [r for r in range(4) if r != o])
    fetched_by_3 = sorted(src for src, dst, _ in plan.moves if dst == 3)
    assert len(fetched_by_3) == 4 and len(set(fetched_by_3)) == 3  # own part + 3 replicas, spread
    assert not plan.lost
    # Nobody else holds rank 3's part: lost.
    statuses = [HolderStatus(True, [r]) for r in range(3)] + [HolderStatus(False, [])]
    assert plan_retrieval(statuses, None).lost == [3]
    # A source that failed before is not chosen again.
    statuses = [HolderStatus(True, [0, 1]), HolderStatus(False, [0, 1], [[0, 1]])]
    assert plan_retrieval(statuses, None).lost == [1]
    # A replica comes from the origin, whose part the load verified, rather than from another
    # holder's copy (only its header was checked), when both are as busy.
    statuses = [HolderStatus(True, [0, 1]), HolderStatus(True, [0, 1]), HolderStatus(True, [2])]
    plan = plan_retrieval(statuses, lambda o: [r for r in range(3) if r != o])
    assert (0, 2, 0) in plan.moves and (1, 2, 1) in plan.moves


# ------------------------------------------------------------------------------------ save, lose, load


def _save(rank: int, world: int, root: str, iterations: list[int], lazy: bool) -> list[str]:
    _as_node(rank)
    manager = _manager(root, lazy=lazy, keep_last=2)
    for it in iterations:
        manager.save(BasicTensorAwareStateDict(make_state(rank, it)), it)
    return _files(Path(root), rank)


def _load(rank: int, world: int, root: str, lazy: bool = False) -> tuple[int, list[str]]:
    _as_node(rank)
    records = WarningRecords()
    manager = _manager(root, lazy=lazy)
    iteration = manager.find_latest()
    if iteration != -1:
        ta, _ = manager.load()
        assert_bitwise_equal(ta.state_dict, make_state(rank, iteration))
        manager.wait_for_restore()  # replicas come back in the background
    return iteration, records.messages


def test_wiped_node_is_restored_from_peers(tmp_path: Path) -> None:
    lazy = True  # the lazy strategy sets itself up inside the first save / find_latest
    listings = run_ranks(_save, WORLD, str(tmp_path), [3, 7], lazy)
    peer = {0: 2, 1: 3, 2: 0, 3: 1}
    for rank in range(WORLD):
        expected = {part_name(it, r) for it in (3, 7) for r in (rank, peer[rank])}
        assert set(listings[rank]) == expected
    # Node 1 (ranks 2 and 3) is replaced: its root is empty.
    for rank in (2, 3):
        shutil.rmtree(tmp_path / "job" / str(rank))
    results = run_ranks(_load, WORLD, str(tmp_path), lazy)
    assert [it for it, _ in results] == [7] * WORLD
    # After the load, node 1 holds its own parts and its replicas of node 0's parts again.
    for rank in (2, 3):
        assert set(_files(tmp_path, rank)) >= {part_name(7, rank), part_name(7, peer[rank])}
    # ... so losing node 0 now is survivable too.
    for rank in (0, 1):
        shutil.rmtree(tmp_path / "job" / str(rank))
    assert [it for it, _ in run_ranks(_load, WORLD, str(tmp_path))] == [7] * WORLD


def _load_then_rank_0_dies(rank: int, world: int, root: str) -> tuple[float, list[str]]:
    import time

    from tierpoint import transfer

    _as_node(rank)
    records = WarningRecords()
    manager = _manager(root)
    if rank == 0:
        real = transfer.move_files

        def dies_in_the_background(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                os._exit(3)  # gone while the replica of its part is on its way to rank 2
            return real(*args, **kwargs)

        transfer.move_files = dies_in_the_background
    manager.find_latest()
    ta, _ = manager.load()
    assert_bitwise_equal(ta.state_dict, make_state(rank, 3))
    start = time.monotonic()
    manager.wait_for_restore()
    return time.monotonic() - start, records.messages


def test_a_peer_lost_while_replicas_come_back_is_a_warning_not_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_ranks(_save, WORLD, str(tmp_path), [3], False)
    for rank in (2, 3):
        shutil.rmtree(tmp_path / "job" / str(rank))
    monkeypatch.setenv("TIERPOINT_TIMEOUT", "20")
    results = run_ranks(_load_then_rank_0_dies, WORLD, str(tmp_path), allow_crash={0}, timeout=150)
    seconds, messages = results[2]
    assert seconds < 60
    assert any("could not restore the replica of rank 0's part" in m for m in messages), messages
    node1 = tmp_path / "job"
    assert not (node1 / "2" / part_name(3, 0)).exists()  # no partial replica, no dirty file
    assert not [p for p in (node1 / "2").iterdir() if p.name.endswith(".dirty")]
    assert (node1 / "2" / part_name(3, 2)).exists()  # its own part came back before load returned
    assert (node1 / "3" / part_name(3, 1)).exists()  # rank 1's replica reached rank 3


def test_corrupt_part_is_replaced_with_a_warning(tmp_path: Path) -> None:
    run_ranks(_save, WORLD, str(tmp_path), [4], False)
    victim = tmp_path / "job" / "1" / part_name(4, 1)
    data = flip_tensor_byte(victim)
    results = run_ranks(_load, WORLD, str(tmp_path))
    assert [it for it, _ in results] == [4] * WORLD
    warning = [m for m in results[1][1] if "replaced" in m]
    assert warning and warning[0].count(str(victim)) == 1 and "rank 3" in warning[0]
    assert "checksum" in warning[0]  # why it was replaced
    assert victim.read_bytes() != bytes(data)  # the good copy now sits on disk


def _load_then_save_next(rank: int, world: int, root: str) -> tuple[int, int, list[str]]:
    _as_node(rank)
    records = WarningRecords()
    manager = _manager(root, keep_last=2)
    ta, ckpt = manager.load()
    assert_bitwise_equal(ta.state_dict, make_state(rank, ckpt.iteration))
    manager.save(
        BasicTensorAwareStateDict(make_state(rank, ckpt.iteration + 1)), ckpt.iteration + 1
    )
    return ckpt.iteration, manager.find_latest(), records.messages


def test_a_part_corrupt_on_every_holder_is_never_loaded_and_saving_goes_on(tmp_path: Path) -> None:
    run_ranks(_save, WORLD, str(tmp_path), [5, 9], False)
    for holder in (1, 3):  # rank 1's part of iteration 9 and its only replica
        flip_tensor_byte(tmp_path / "job" / str(holder) / part_name(9, 1))
    results = run_ranks(_load_then_save_next, WORLD, str(tmp_path))
    # Iteration 9 cannot be had bitwise on rank 1: every rank resumes from 5 and saves 6 over 9.
    assert [(loaded, latest) for loaded, latest, _ in results] == [(5, 6)] * WORLD
    assert not any("replaced by the copy" in m for m in results[1][2])
    assert any("no rank holds a good copy of the part of rank 1" in m for m in results[0][2])
    assert not any(part_name(9, 1) in name for r in range(WORLD) for name in _files(tmp_path, r))
    assert [it for it, _ in run_ranks(_load, WORLD, str(tmp_path))] == [6] * WORLD


def test_losing_a_whole_clique_falls_back_or_says_so(tmp_path: Path) -> None:
    run_ranks(_save, WORLD, str(tmp_path), [5, 9], False)
    # Clique {0, 2} loses every copy of iteration 9: 5 is the newest complete one.
    for holder in (0, 2):
        for origin in (0, 2):
            (tmp_path / "job" / str(holder) / part_name(9, origin)).unlink()
    results = run_ranks(_load, WORLD, str(tmp_path))
    assert [it for it, _ in results] == [5] * WORLD
    assert any("iteration 9 is incomplete" in m and "ranks 0, 2" in m for m in results[0][1])
    # Both nodes of the clique wiped entirely: nothing complete remains.
    for holder in (0, 2):
        shutil.rmtree(tmp_path / "job" / str(holder))
    results = run_ranks(_load, WORLD, str(tmp_path))
    assert [it for it, _ in results] == [-1] * WORLD
    assert any("no older complete iteration" in m for m in results[0][1])


# ------------------------------------------------------------------------------------ async


def _async_saves(rank: int, world: int, root: str) -> list[list[str]]:
    _as_node(rank)
    manager = _manager(root)
    seen = []
    with AsyncCallsQueue() as queue:
        for it in (1, 2, 3):
            queue.schedule_async_request(
                manager.save(BasicTensorAwareStateDict(make_state(rank, it)), it, is_async=True)
            )
            # Until finalized, the previous iteration (and its replicas) must still be there.
            seen.append(_files(Path(root), rank))
            queue.maybe_finalize_async_calls(blocking=True)
    seen.append(_files(Path(root), rank))
    return seen


def test_async_saves_replicate_in_the_background(tmp_path: Path) -> None:
    seen = run_ranks(_async_saves, WORLD, str(tmp_path), timeout=180)
    for rank, peer in ((0, 2), (1, 3), (2, 0), (3, 1)):
        for it, listing in zip((1, 2, 3), seen[rank]):
            if it > 1:
                assert {part_name(it - 1, rank), part_name(it - 1, peer)} <= set(listing)
        assert seen[rank][-1] == sorted([part_name(3, rank), part_name(3, peer)])
    for rank in (2, 3):
        shutil.rmtree(tmp_path / "job" / str(rank))
    assert [it for it, _ in run_ranks(_load, WORLD, str(tmp_path))] == [3] * WORLD
