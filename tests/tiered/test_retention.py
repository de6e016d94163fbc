"""The persistent tier's retention: it runs on a thread of rank 0 while training goes on, the next
persistent save starts only after it, and it leaves the newest ``keep_persistent`` steps."""

from __future__ import annotations

import threading
import time

import pytest

from tierpoint import TieredCheckpointManager, storage

from .helpers import make_state, train_step

GATE_S = 10.0  # how long a held removal waits for the training thread before giving up


def test_retention_runs_beside_training_and_before_the_next_persistent_save(
    tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """A removal of an old step is held until the training thread has gone on with later steps
    (``maybe_save`` polling, not saving): if the removal ran on the training thread, the hold would
    time out instead. The next persistent save then finds it finished."""
    removal_running, training_went_on = threading.Event(), threading.Event()
    removals: list[tuple[str, bool]] = []
    existing_when_removing: list[list[str]] = []
    remove_files = storage.remove_files

    def held_removal(path, names, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if not any(name.endswith(".distcp") for name in names):  # a commit's markers
            return remove_files(path, names, *args, **kwargs)
        removal_running.set()
        released = training_went_on.wait(GATE_S)
        removals.append((threading.current_thread().name, released))
        existing_when_removing.append(sorted(p.name for p in tmp_path.iterdir()))
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
        training_went_on.set()
        train_step(state, 1)
        manager.save(step, state, tiers="persistent")  # waits for the retirement of step 1
        assert [name for name, _ in removals] == ["tierpoint-retention"]
    assert went_on_while_removing
    assert removals == [("tierpoint-retention", True), ("tierpoint-retention", True)]
    # step 1 was removed before the save of the next step began: that step did not exist yet
    assert existing_when_removing[0] == ["step-1", "step-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{step}"]
