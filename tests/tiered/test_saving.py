"""The persistent copy of a step due for both tiers is made from its local part: the training
thread copies nothing for it (the DCP snapshot never calls the copy engine, no staging buffer is
filled: the worker writes the part's bytes), and each persistent step holds the bytes of its own
step, bit for bit with torch's loader and tierpoint's, even with ``keep_local=1``, a save at every
step and a worker slowed down, so that its reads of a part come after the next saves began."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tierpoint import TieredCheckpointManager, dcp
from tierpoint.dcp import snapshot as dcp_snapshot
from tierpoint.dcp import step_path
from tierpoint.errors import CheckpointingError
from tierpoint.testing import run_ranks

from ..mounts import small_tmpfs
from .helpers import (
    as_node,
    assert_same,
    fail_local_writes,
    fail_persistent_writes,
    fingerprint,
    make_state,
    slow_down_persistent_writes,
    train_step,
)

STEPS = 5


def _expected(state: dict[str, Any]) -> dict[str, Any]:
    """What a persistent step must hold of ``state``: every parameter and optimizer moment."""
    optimizer = state["optimizer"].state_dict()["state"]
    return {
        "model": {k: v.detach().clone() for k, v in state["model"].state_dict().items()},
        "moments": {
            f"{i}.{name}": v.clone()
            for i, s in optimizer.items()
            for name, v in s.items()
            if torch.is_tensor(v)
        },
    }


def _loaded(path: str, work: Path) -> dict[str, Any]:
    """A persistent step read back by torch's own loader (no template) and by tierpoint's."""
    out = work / "step.pt"
    dcp_to_torch_save(path, out)
    plain = torch.load(out, weights_only=False)
    model = {k: torch.zeros_like(v) for k, v in plain["model"].items()}
    dcp.load({"model": model}, path)
    assert all(torch.equal(model[k], plain["model"][k]) for k in model)
    moments = {
        f"{i}.{name}": v
        for i, s in plain["optimizer"]["state"].items()
        for name, v in s.items()
        if torch.is_tensor(v)
    }
    return {"model": model, "moments": moments}


def _saving_every_step(root: Path, events: list, **kwargs: Any) -> TieredCheckpointManager:
    """A manager saving every step to both tiers (unless ``kwargs`` say otherwise), one local part
    kept, no replicas."""
    options = {"persistent_every": 1, "keep_local": 1, "replication_factor": 1, **kwargs}
    return TieredCheckpointManager(
        str(root / "local"),
        str(root / "persistent"),
        "job",
        local_every=1,
        on_event=events.append,
        **options,
    )


def _save_every_step(rank: int, world: int, root: Path) -> dict[str, Any]:
    slow_down_persistent_writes()
    copies: list[int] = []
    engine = dcp_snapshot.copy_tensors

    def counted(sources, targets, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        copies.append(len(sources))
        return engine(sources, targets, *args, **kwargs)

    dcp_snapshot.copy_tensors = counted
    state, expected, events = make_state(rank, width=64), {}, []
    with _saving_every_step(root, events, keep_persistent=STEPS) as manager:
        for step in range(1, STEPS + 1):
            train_step(state, world)
            manager.maybe_save(step, state)
            expected[step] = _expected(state)
    persistent = [e for e in events if e.get("tier") == "persistent"]
    work = root / f"work{rank}"
    work.mkdir()
    mismatched = []
    for step in range(1, STEPS + 1):
        got = _loaded(step_path(root / "persistent", step), work)
        for group in ("model", "moments"):
            for key, value in expected[step][group].items():
                if not torch.equal(got[group][key], value):
                    mismatched.append((step, group, key))
    return {
        "copies": copies,
        "persistent": [(e["step"], e["ok"], "copy_from_local" in e["phases"]) for e in persistent],
        "mismatched": mismatched,
    }


def test_the_copy_from_the_local_part_costs_the_trainer_no_copy_and_holds_its_own_step(shm_dir):
    for out in run_ranks(_save_every_step, 2, shm_dir, timeout=240):
        assert out["copies"] == []  # the trainer never copied a tensor for a persistent save
        assert out["persistent"] == [(s, True, True) for s in range(1, STEPS + 1)]
        assert out["mismatched"] == []


def _part_files_made(rank: int, world: int, root: Path, slow: bool) -> dict[str, Any]:
    """The files (inodes) of this rank's local directory over steady saves, with the collector
    off: a file freed only by a garbage collection would be a new file at a later save."""
    import gc

    if slow:  # each persistent copy still reads its part after the next local saves committed
        slow_down_persistent_writes()
    state, events = make_state(rank, width=64), []
    manager = _saving_every_step(root, events, persistent_every=3, keep_local=2)
    inodes: dict[int, set[int]] = {}
    gc.disable()
    try:
        with manager:
            for step in range(1, 25):
                train_step(state, world)
                manager.maybe_save(step, state)
                inodes[step] = {e.inode() for e in os.scandir(root / "local" / "job" / str(rank))}
    finally:
        gc.enable()
    steady = set().union(*(inodes[s] for s in range(13, 25)))
    before = set().union(*(inodes[s] for s in range(1, 13)))
    failed = [e for e in events if not e["ok"]]
    return {"new": len(steady - before), "failed": failed}


@pytest.mark.parametrize("slow", [False, True], ids=["copy-in-time", "slow-copy"])
def test_steady_saves_with_persistent_copies_make_no_new_part_files(shm_dir, slow):
    """A part held for a persistent copy is given back to the local tier as soon as the copy is
    finalized (no garbage collection needed), and a part still held when it is retired becomes a
    spare for a later save: steady saves rewrite the same files, never allocate (and, for CUDA
    states, pin) new ones."""
    for out in run_ranks(_part_files_made, 2, shm_dir, slow, timeout=240):
        assert out["failed"] == []
        assert out["new"] == 0


def _saves_during_an_upload(rank: int, world: int, root: Path) -> list[tuple[str, int]]:
    os.environ["TEST_SLOW_WRITE"] = "3"  # (the workers start with the manager: they see it)
    slow_down_persistent_writes()
    state, events = make_state(rank, width=64), []
    with _saving_every_step(root, events, persistent_every=4, keep_local=2) as manager:
        for step in range(1, 9):
            train_step(state, world)
            manager.maybe_save(step, state)
    assert all(e["ok"] for e in events), events
    return [(e["tier"], e["step"]) for e in events]


def test_local_saves_never_wait_behind_a_persistent_upload(shm_dir):
    """Each tier has its own worker: while the persistent copy of step 4 uploads (3 s), the local
    saves of the next steps are written and committed."""
    for done in run_ranks(_saves_during_an_upload, 2, shm_dir, timeout=240):
        upload = done.index(("persistent", 4))
        assert {("local", 5), ("local", 6), ("local", 7)} <= set(done[:upload]), done


def _failing_copies(rank: int, world: int, root: Path) -> dict[str, Any]:
    fail_persistent_writes()
    state, events, holds = make_state(rank), [], []
    with _saving_every_step(root, events) as manager:
        hold = manager.local.hold_own_part
        manager.local.hold_own_part = lambda step: holds.append(hold(step)) or holds[-1]
        for step in range(1, STEPS + 1):
            train_step(state, world)
            manager.maybe_save(step, state)
        manager.wait()
    return {
        "saves": [(e["tier"], e["step"], e["ok"]) for e in events],
        "held": [(h.iteration, h.held) for h in holds],
    }


def test_a_persistent_copy_that_fails_in_the_worker_gives_the_local_part_back(shm_dir):
    (out,) = run_ranks(_failing_copies, 1, shm_dir, timeout=120)
    assert [s for s in out["saves"] if s[0] == "local"] == [
        ("local", s, True) for s in range(1, STEPS + 1)
    ]
    assert [s for s in out["saves"] if s[0] == "persistent"] == [
        ("persistent", s, False) for s in range(1, STEPS + 1)
    ]
    assert out["held"] == [(s, False) for s in range(1, STEPS + 1)]  # every hold released


def test_a_local_tier_that_fails_does_not_leave_the_persistent_tier_empty(tmp_path, monkeypatch):
    """The local tier fills up after step 2 (every later local save fails): the persistent copy
    of step 4, which was to be made from its local part, is made up for at the next step the
    manager sees the failure, from the state; step 8's is snapshotted from the state while the
    local tier fails. Both restore bit for bit."""
    events: list = []
    kwargs = {"local_every": 2, "persistent_every": 4, "replication_factor": 1}
    state = make_state(0)
    reference = {}
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    with TieredCheckpointManager(
        str(local), str(persistent), "job", on_event=events.append, **kwargs
    ) as manager:
        for step in range(1, 10):
            if step == 4:
                manager.wait()  # step 2 is in the local tier
                fail_local_writes(monkeypatch)
            train_step(state, 1)
            manager.maybe_save(step, state)
            reference[step] = fingerprint(state)
    saved = {(e["tier"], e["step"], e["ok"]) for e in events if e["kind"] == "save"}
    assert {("local", 2, True), ("local", 4, False), ("local", 6, False)} <= saved
    (failed,) = [e for e in events if e.get("tier") == "local" and e["step"] == 4]
    assert "No space left on device" in failed["error"], failed  # the reason, not only "failed"
    steps = sorted(int(p.name.removeprefix("step-")) for p in persistent.iterdir())
    assert len(steps) == 2 and steps[0] in (5, 6, 7) and steps[1] == 8, steps
    assert ("persistent", 4, True) not in saved
    for step in reversed(steps):  # the newest, then (with it gone) the made-up one
        restored = make_state(0)
        with TieredCheckpointManager(None, str(persistent), "job", local_every=0) as manager:
            assert manager.restore(restored) == step
        assert_same(fingerprint(restored), reference[step])
        shutil.rmtree(persistent / f"step-{step}")


def test_a_local_directory_that_cannot_be_made_fails_local_saves_not_training(tmp_path, caplog):
    """A file where the local tier's directory should be: every local save fails with a WARNING
    and a failed record, and the persistent tier goes on saving (``maybe_save`` raised, and no
    persistent checkpoint was ever written)."""
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "job").write_text("in the way")
    state = make_state(0)
    kwargs = {"local_every": 1, "persistent_every": 2, "replication_factor": 1}
    events: list[dict] = []
    persistent = tmp_path / "persistent"
    with TieredCheckpointManager(
        str(tmp_path / "local"), str(persistent), "job", on_event=events.append, **kwargs
    ) as manager:
        for step in range(1, 5):
            train_step(state, 1)
            manager.maybe_save(step, state)
    local = [e for e in events if e.get("tier") == "local"]
    assert [e["ok"] for e in local] == [False] * 4 and "failed" in local[0]["error"]
    assert sorted(p.name for p in persistent.iterdir()) == ["step-2", "step-4"]
    assert "the local save of step 1 failed; training goes on" in caplog.text


def _save_keeping(rank: int, world: int, root: Path, differing: str) -> str:
    as_node(rank)
    state = make_state(rank)
    kwargs = {"local_every": 1, "keep_local": 1 + rank if differing == "keep_local" else 2}
    session = f"job-{rank}" if differing == "session_id" else "job"
    try:
        with TieredCheckpointManager(str(root / "node0"), None, session, **kwargs) as manager:
            train_step(state, world)
            manager.maybe_save(1, state)
    except CheckpointingError as e:
        return str(e)
    return "saved"


@pytest.mark.parametrize(
    "differing, said",
    [
        ("keep_local", "same settings, got keep_local {0: 1, 1: 2}"),
        ("session_id", "same settings, got session_id {0: 'job-0', 1: 'job-1'}"),
    ],
)
def test_a_local_save_refused_as_misuse_raises_on_every_rank(shm_dir, differing, said):
    """Ranks keeping different numbers of local checkpoints, or naming different sessions (each
    would save into its own directory, and no restore would find an iteration complete): misuse,
    raised on every rank when the manager is made (the local tier's own refusal at its save:
    tests/local), not a failed save each step with a WARNING."""
    messages = run_ranks(_save_keeping, 2, shm_dir, differing)
    assert all(said in m for m in messages), messages


def test_a_persistent_commit_that_fills_the_disk_is_a_failed_save_on_record(tmp_path, caplog):
    """The data files fit, ``.metadata`` does not: the commit (a finalize step) fails. That save
    is a failed record with the reason and a WARNING like any failed save (no record at all was
    emitted), step 1 stays restorable, and once there is room the next save commits."""
    state, events = make_state(0), []
    with small_tmpfs(tmp_path / "persistent", "2m") as persistent:
        with TieredCheckpointManager(
            None, str(persistent), "job", local_every=0, persistent_every=1, on_event=events.append
        ) as manager:
            train_step(state, 1)
            manager.maybe_save(1, state)
            manager.wait()
            step_one = fingerprint(state)
            files = [p for p in (persistent / "step-1").iterdir() if p.name != ".metadata"]
            data = sum(p.stat().st_blocks * 512 for p in files)  # step 2 but for its .metadata
            free = os.statvfs(persistent)
            (persistent / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - data))
            train_step(state, 1)
            manager.maybe_save(2, state)
            manager.wait()
            assert sorted(p.name for p in persistent.iterdir()) == ["filler", "step-1"]
            (persistent / "filler").unlink()
            train_step(state, 1)
            manager.maybe_save(3, state)
            manager.wait()
            shutil.rmtree(persistent / "step-3")
            restored = make_state(0)
            assert manager.restore(restored) == 1
            assert_same(fingerprint(restored), step_one)
    saves = [(e["tier"], e["step"], e["ok"]) for e in events if e["kind"] == "save"]
    assert saves == [("persistent", 1, True), ("persistent", 2, False), ("persistent", 3, True)]
    (failed,) = [e for e in events if e.get("step") == 2]
    assert ".metadata" in failed["error"] and "No space left" in failed["error"], failed
    assert "persistent checkpoint of step 2 failed; training goes on" in caplog.text
