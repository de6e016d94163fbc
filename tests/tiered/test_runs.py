"""A new run on the nodes of an earlier one, with its session_id but its own persistent_dir, is
refused the earlier run's local steps rather than resuming them; a restart of the run itself (its
persistent_dir spelled another way too) restores them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierpoint import TieredCheckpointManager
from tierpoint.errors import CheckpointingError
from tierpoint.testing import run_ranks

from .helpers import as_node, assert_same, fingerprint, make_state, train_step


def _manager(root: Path, rank: int, persistent: str, session: str = "job"):
    local = str(root / f"node{as_node(rank, ranks_per_node=1)}")
    return TieredCheckpointManager(
        local, persistent, session, local_every=2, persistent_every=100, keep_local=2
    )


def _runs(rank: int, world: int, root: Path) -> dict:
    state = make_state(rank)
    with _manager(root, rank, str(root / "run-a")) as manager:  # run A: local steps 2 and 4
        assert manager.restore(state) is None
        for step in range(1, 5):
            train_step(state, world)
            manager.maybe_save(step, state)
    saved = fingerprint(state)
    files = {p: p.read_bytes() for p in root.rglob("*.safetensors")}

    fresh = make_state(rank)
    with _manager(root, rank, str(root / "run-b")) as manager:  # run B, A's session: refused
        with pytest.raises(CheckpointingError, match="saved by another run") as raised:
            manager.restore(fresh)
    assert {p: p.read_bytes() for p in root.rglob("*.safetensors")} == files  # nothing lost
    assert_same(fingerprint(fresh), fingerprint(make_state(rank)))  # the state untouched

    with _manager(root, rank, str(root / "run-b"), session="job-b") as manager:  # its own session
        assert manager.restore(make_state(rank)) is None

    os.chdir(root)  # run A restarted, its persistent_dir given relative and with a trailing slash
    state = make_state(rank)
    with _manager(root, rank, "run-a/") as manager:
        step = manager.restore(state)
    assert_same(fingerprint(state), saved)
    return {"message": str(raised.value), "step": step}


def test_a_new_run_with_an_earlier_runs_session_is_refused_its_local_steps(shm_dir):
    results = run_ranks(_runs, 2, shm_dir)
    for result in results:
        assert result["step"] == 4
        message = result["message"]
        assert str(shm_dir / "run-a") in message and str(shm_dir / "run-b") in message
        assert "needs its own session_id" in message


def _spelled_otherwise(rank: int, world: int, root: Path) -> list:
    state = make_state(rank)
    with _manager(root, rank, str(root / "real" / "run-a")) as manager:  # local steps 2 and 4
        for step in range(1, 5):
            train_step(state, world)
            manager.maybe_save(step, state)
    steps = []
    for spelled in (str(root / "link" / "run-a"), f"file://{root}/real/run-a"):
        with _manager(root, rank, spelled) as manager:
            steps.append(manager.restore(make_state(rank)))
    return steps


def test_a_restart_naming_its_persistent_dir_through_a_link_or_as_a_file_url_restores(shm_dir):
    """The same directory, reached through a symbolic link (a home directory that is a link to a
    parallel file system) or named as a file:// URL, is the same run: its local steps restore."""
    (shm_dir / "real").mkdir()
    (shm_dir / "link").symlink_to(shm_dir / "real", target_is_directory=True)
    assert run_ranks(_spelled_otherwise, 2, shm_dir) == [[4, 4]] * 2
