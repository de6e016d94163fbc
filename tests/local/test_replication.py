"""Peer replication on 4 real gloo ranks, two simulated nodes (ranks 0-1 and 2-3).

Cliques with the default jump (2 ranks per node) and factor 2 are {0, 2} and {1, 3}: every part has a
copy on the other node.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.errors import CheckpointingError, SameMachineReplicationException
from tierpoint.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
)
from tierpoint.local.naming import part_name
from tierpoint.testing import run_ranks

from .helpers import (
    WarningRecords,
    as_node,
    load_latest,
    make_state,
    open_sockets,
    part_files,
    replicated_manager,
)

WORLD = 4


# ------------------------------------------------------------------------------------ strategy


def _strategy_checks(rank: int, world: int) -> dict:
    """Everything about building strategies, on one set of 4 ranks (2 per simulated node)."""
    as_node(rank)
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


def _one_copy(rank: int, world: int, root: str) -> list[list[int]]:
    """3 ranks on nodes of 2 and 1 ranks: one copy needs no jump, whatever the nodes."""
    as_node(rank)
    cliques = []
    for session, jump in (("derived", None), ("given", 2)):
        strategy = CliqueReplicationStrategy.from_replication_params(jump, 1)
        manager = LocalCheckpointManager(root, session_id=session, repl_strategy=strategy)
        manager.save(BasicTensorAwareStateDict(make_state(rank, 1)), 1)
        cliques.append(strategy.clique(rank))
    return cliques


def test_one_copy_saves_on_any_layout(tmp_path: Path) -> None:
    """replication_factor=1 (no copies) refused every save on nodes of different sizes ("cannot
    derive replication_jump") or with a jump that does not divide the world size."""
    results = run_ranks(_one_copy, 3, str(tmp_path))
    assert results == [[[rank], [rank]] for rank in range(3)]


def _one_node_default_jump(rank: int, world: int) -> str:
    as_node(rank, ranks_per_node=world)  # both ranks on one node, as a single-machine trial run
    with pytest.raises(CheckpointingError) as raised:
        CliqueReplicationStrategy.from_replication_params(replication_factor=2)
    return str(raised.value)


def test_a_derived_jump_that_does_not_fit_is_named_as_derived() -> None:
    """Without replication_jump the error named a value the user never passed; it says where it
    came from (the ranks per node) and what to do."""
    for message in run_ranks(_one_node_default_jump, 2, timeout=60):
        assert "2 * 2 = 4" in message
        assert "replication_jump was not given" in message and "1 node(s)" in message


# ------------------------------------------------------------------------------------ async


def _async_saves(rank: int, world: int, root: str) -> list[list[str]]:
    as_node(rank)
    manager = replicated_manager(root)
    seen = []
    with AsyncCallsQueue() as queue:
        for it in (1, 2, 3):
            queue.schedule_async_request(
                manager.save(BasicTensorAwareStateDict(make_state(rank, it)), it, is_async=True)
            )
            # Until finalized, the previous iteration (and its replicas) must still be there.
            seen.append(part_files(Path(root), rank))
            queue.maybe_finalize_async_calls(blocking=True)
    seen.append(part_files(Path(root), rank))
    return seen


def _mismatched_settings(rank: int, world: int) -> list[str]:
    """Ranks 0-1 replicate with jump 2, ranks 2-3 with jump 1; then the factors differ."""
    as_node(rank)
    messages = []
    for jump, factor in (((2 if rank < 2 else 1), 2), (1, (2 if rank % 2 else 4))):
        with pytest.raises(CheckpointingError, match="different settings") as raised:
            CliqueReplicationStrategy.from_replication_params(jump, factor)
        messages.append(str(raised.value))
    return messages


def test_ranks_with_different_replication_settings_are_refused_at_set_up() -> None:
    """Every rank raises at once, naming the settings (before: each save waited for copies its
    peers never sent and failed after the coordination timeout, naming no cause)."""
    for messages in run_ranks(_mismatched_settings, WORLD, timeout=60):
        assert "replication_jump from 1 to 2, replication_factor from 2 to 2" in messages[0]
        assert "replication_jump from 1 to 1, replication_factor from 2 to 4" in messages[1]


def test_async_saves_replicate_in_the_background(tmp_path: Path) -> None:
    seen = run_ranks(_async_saves, WORLD, str(tmp_path), timeout=180)
    for rank, peer in ((0, 2), (1, 3), (2, 0), (3, 1)):
        for it, listing in zip((1, 2, 3), seen[rank]):
            if it > 1:
                assert {part_name(it - 1, rank), part_name(it - 1, peer)} <= set(listing)
        assert seen[rank][-1] == sorted([part_name(3, rank), part_name(3, peer)])
    for rank in (2, 3):
        shutil.rmtree(tmp_path / "job" / str(rank))
    assert [it for it, _ in run_ranks(load_latest, WORLD, str(tmp_path))] == [3] * WORLD


# ------------------------------------------------------------------------------------ failures


def _no_space(*args: object, **kwargs: object) -> int:
    """The local tier's worker job, failing as on a full RAM disk (the worker imports it)."""
    raise OSError(28, "No space left on device")


def _failing_saves(rank: int, world: int, root: str) -> list[int]:
    """Async saves that fail on every rank (a full RAM disk), then one that succeeds; the sockets
    this process holds after the first failure and after each later one."""
    from tierpoint.local import saving

    as_node(rank, 1)
    manager = replicated_manager(root)
    written = saving.write_staged_part, saving.seal_staged_part
    saving.write_staged_part = saving.seal_staged_part = _no_space
    sockets = []
    with AsyncCallsQueue() as queue:
        for it in range(1, 11):
            state = BasicTensorAwareStateDict(make_state(rank, it))
            queue.schedule_async_request(manager.save(state, it, is_async=True))
            with pytest.raises(CheckpointingError, match="No space left"):
                queue.maybe_finalize_async_calls(blocking=True)
            sockets.append(open_sockets())
        saving.write_staged_part, saving.seal_staged_part = written
        state = BasicTensorAwareStateDict(make_state(rank, 11))
        queue.schedule_async_request(manager.save(state, 11, is_async=True))
        queue.maybe_finalize_async_calls(blocking=True)
    assert part_files(Path(root), rank) == sorted([part_name(11, 0), part_name(11, 1)])
    return sockets


def test_failed_saves_leave_no_replication_groups_behind(tmp_path: Path) -> None:
    """Each failed save replaces the strategy's gloo groups; the old ones are freed (before: every
    failed save left two groups, their sockets and threads, for the life of the process, so a RAM
    disk full for a while ran a long job out of file descriptors)."""
    for sockets in run_ranks(_failing_saves, 2, str(tmp_path), timeout=120):
        assert max(sockets) <= sockets[0], sockets
