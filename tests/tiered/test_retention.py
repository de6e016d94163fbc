"""The persistent tier's retention: it runs on a thread of rank 0 while training and the next
persistent save go on, and it leaves the newest ``keep_persistent`` steps."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tierpoint import TieredCheckpointManager, storage
from tierpoint.testing import run_ranks

from .helpers import make_state, train_step

GATE_S = 10.0  # how long a held removal waits for the training thread before giving up


def test_retention_runs_beside_training_and_the_next_persistent_save(
    tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """A removal of an old step is held until the training thread has gone on with later steps
    (``maybe_save`` polling, not saving) and scheduled the next persistent save: if either waited
    for the removal, the hold would time out instead."""
    removal_running, training_went_on = threading.Event(), threading.Event()
    removals: list[tuple[str, bool]] = []
    remove_files = storage.remove_files

    def held_removal(path, names, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if not any(name.endswith(".distcp") for name in names):  # a commit's markers
            return remove_files(path, names, *args, **kwargs)
        removal_running.set()
        released = training_went_on.wait(GATE_S)
        removals.append((threading.current_thread().name, released))
        return remove_files(path, names, *args, **kwargs)

    monkeypatch.setattr(storage, "remove_files", held_removal)
    state = make_state(0)
    kwargs = {"local_every": 0, "persistent_every": 1000, "keep_persistent": 1, "poll_every": 1}
    with TieredCheckpointManager(None, str(tmp_path), "r", **kwargs) as manager:
        for step in (1, 2):
            train_step(state, 1)
            manager.save(step, state, tiers="persistent")
        deadline = time.monotonic() + GATE_S
        step = 3
        while not removal_running.is_set() and time.monotonic() < deadline:
            train_step(state, 1)
            manager.maybe_save(step, state)  # not due: polls, commits step 2, retires step 1
            step += 1
            time.sleep(0.02)
        went_on_while_removing = removal_running.is_set()
        train_step(state, 1)
        manager.save(step, state, tiers="persistent")  # beside the retirement of step 1
        training_went_on.set()
    assert went_on_while_removing
    # step 1 went while step `step` was saved, step 2 after its commit (close waits for that)
    assert removals == [("tierpoint-retention", True), ("tierpoint-retention", True)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{step}"]


def test_retention_below_the_committed_step_leaves_newer_ones_alone(tmp_path):
    """Steps at or above ``below`` (the one just committed, and the saves after it: one in flight
    here, step 7 without its ``.metadata``) are never touched, even under a newer complete step."""
    from tierpoint.tiered.retention import retire_persistent_steps

    for step in (2, 4, 6, 7, 8):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / "__0_0.x.distcp").write_bytes(b"data")
        if step != 7:
            (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"m")
    assert retire_persistent_steps(str(tmp_path), 1, below=6) == [2, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-6", "step-7", "step-8"]


def test_commits_faster_than_retention_still_leave_keep_persistent_steps(
    tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """On a slow store commits come while an older step is still being removed: the retention
    then runs once more when it is done, so closing leaves the newest ``keep_persistent`` steps,
    not the ones committed meanwhile too."""
    remove_files = storage.remove_files

    def slow_removal(path, names, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if any(name.endswith(".distcp") for name in names):  # an old step, not a commit's markers
            time.sleep(1.0)
        return remove_files(path, names, *args, **kwargs)

    monkeypatch.setattr(storage, "remove_files", slow_removal)
    state = make_state(0)
    kwargs = {"local_every": 0, "persistent_every": 1000, "keep_persistent": 1}
    with TieredCheckpointManager(None, str(tmp_path), "r", **kwargs) as manager:
        for step in (1, 2, 3, 4):  # each save finalizes the one before: commits 1, 2, 3
            train_step(state, 1)
            manager.save(step, state, tiers="persistent")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]


def _slow_retention_then_list(rank: int, world: int, root: str) -> list[str]:
    """Rank 0's removals take a second; every rank lists the persistent tier after ``wait()``."""
    if rank == 0:
        remove_files = storage.remove_files

        def slow_removal(path, names, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            time.sleep(1.0)
            return remove_files(path, names, *args, **kwargs)

        storage.remove_files = slow_removal
    state = make_state(rank)
    kwargs = {"local_every": 0, "persistent_every": 1, "keep_persistent": 1}
    with TieredCheckpointManager(None, root, "r", **kwargs) as manager:
        for step in (1, 2):
            train_step(state, world)
            manager.maybe_save(step, state)
        manager.wait()
        return sorted(p.name for p in Path(root).iterdir())


def test_wait_returns_on_every_rank_once_rank_0_retired_the_old_steps(tmp_path):
    """Only rank 0 removes old persistent steps: the other ranks' ``wait()`` returned while it
    still did, and saw steps ``keep_persistent`` had retired."""
    listings = run_ranks(_slow_retention_then_list, 2, str(tmp_path), timeout=120)
    assert listings == [["step-2"], ["step-2"]]
