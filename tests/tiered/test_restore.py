"""TieredCheckpointManager restores the newest checkpoint complete anywhere: from the local tier,
from peer replicas after a node lost its directory, from an older local step when the newest is
damaged in every copy, and from the persistent tier when every local directory is gone; each
bit for bit, on 4 ranks simulating 2 nodes."""

from __future__ import annotations

import collections
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dcp.s3_server import faulty_endpoint, s3_bucket, s3_server  # noqa: F401 - fixtures
from tierpoint import RankLocal, TieredCheckpointManager
from tierpoint.errors import CheckpointingError, StateMismatchError, StorageUnavailableError
from tierpoint.testing import run_ranks

from ..local.helpers import WarningRecords
from .helpers import as_node, assert_same, fingerprint, make_state, train_step, wipe

EVERY = {"local_every": 2, "persistent_every": 4, "keep_local": 2, "keep_persistent": 2}


def _manager(root: Path, node: int, **kwargs) -> TieredCheckpointManager:
    return TieredCheckpointManager(
        str(root / f"node{node}"), str(root / "persistent"), "job", **{**EVERY, **kwargs}
    )


def _restore(root: Path, node: int, rank: int) -> tuple[object, dict, dict]:
    state = make_state(rank)
    with _manager(root, node) as manager:
        step = manager.restore(state)
        if manager.local is not None:
            manager.local.wait_for_restore()
        record = manager.last_restore
    return step, record, fingerprint(state)


def _wipe_node(root: Path, node: int, rank: int, lost: set[int]) -> None:
    dist.barrier()
    if node in lost and rank % 2 == 0:
        wipe(root / f"node{node}")
    dist.barrier()


def _every_tier(rank: int, world: int, root: Path) -> dict:
    node = as_node(rank)
    state = make_state(rank)
    reference = {}
    with _manager(root, node) as manager:
        assert manager.restore(state) is None
        for step in range(1, 15):
            train_step(state, world)
            manager.maybe_save(step, state)
            if step in (12, 14):
                reference[step] = fingerprint(state)
        manager.wait()
        stats = manager.stats()
    out = {"stats": stats, "persistent": sorted(p.name for p in (root / "persistent").iterdir())}

    step, record, got = _restore(root, node, rank)  # everything in place: the local tier
    assert_same(got, reference[14])
    out["local"] = (step, record.tier)

    _wipe_node(root, node, rank, lost={1})  # node 1 replaced: its ranks fetch from node 0
    step, record, got = _restore(root, node, rank)
    assert_same(got, reference[14])
    out["peers"] = (step, record.tier)

    dist.barrier()  # step 14 damaged in every copy (own parts and replicas): step 12 loads
    for part in (root / f"node{node}" / "job" / str(rank)).glob("*14*"):
        data = bytearray(part.read_bytes())
        data[-20] ^= 0xFF
        part.write_bytes(bytes(data))
    dist.barrier()
    step, record, got = _restore(root, node, rank)
    assert_same(got, reference[12])
    out["older"] = (step, record.tier)
    out["older_skipped"] = record.skipped

    _wipe_node(root, node, rank, lost={0, 1})  # every local directory gone
    step, record, got = _restore(root, node, rank)
    assert_same(got, reference[12])
    out["persistent_restore"] = (step, record.tier)
    return out


def test_restore_takes_the_newest_complete_step_from_each_tier_in_turn(tmp_path, shm_dir):
    persistent = tmp_path / "persistent"
    root = shm_dir
    (root / "persistent").symlink_to(persistent, target_is_directory=False)
    persistent.mkdir()
    results = run_ranks(_every_tier, 4, root, timeout=280)
    for out in results:
        assert out["local"] == (14, "local")
        assert out["peers"] == (14, "peers")
        # node 1's parts of step 12 went with its directory: they come from node 0's replicas
        assert out["older"] == (12, "peers")
        assert any(  # why step 14 was passed over, not only that it was
            "local step 14: rank" in s and "checksum mismatch" in s for s in out["older_skipped"]
        ), out["older_skipped"]
        assert out["persistent_restore"] == (12, "persistent")
        # keep_persistent=2: of the steps 4, 8 and 12 only the newest two are left
        assert out["persistent"] == ["step-12", "step-8"]
        local = out["stats"]["tiers"]["local"]
        assert local["saves"] == 7 and local["failed"] == 0
        assert out["stats"]["tiers"]["persistent"]["saves"] == 3


PERSISTENT_ONLY = {"local_every": 0, "persistent_every": 4, "keep_persistent": 2}


def _save_steps_4_and_8(base: Path, width: int = 16) -> dict:
    """Persistent steps 4 and 8 of a one-rank job; returns step 4's fingerprint."""
    state = make_state(0, width=width)
    with TieredCheckpointManager(None, str(base), "p", **PERSISTENT_ONLY) as manager:
        for step in range(1, 9):
            train_step(state, 1)
            manager.maybe_save(step, state)
            if step == 4:
                reference = fingerprint(state)
    return reference


def _restore_step_4(base: Path, reference: dict, width: int = 16) -> list[str]:
    """Restore, which must fall back to step 4 bit for bit; returns the reasons it skipped."""
    restored = make_state(0, width=width)
    with TieredCheckpointManager(None, str(base), "p", **PERSISTENT_ONLY) as manager:
        assert manager.restore(restored) == 4
        record = manager.last_restore
    assert record.tier == "persistent"
    assert_same(fingerprint(restored), reference)
    assert len(record.skipped) == 1 and "persistent step 8" in record.skipped[0], record.skipped
    return record.skipped


def test_a_persistent_step_damaged_inside_a_tensor_is_skipped_for_the_older_one(tmp_path):
    reference = _save_steps_4_and_8(tmp_path, width=64)
    newest = max((tmp_path / "step-8").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(newest.read_bytes())
    data[len(data) // 3] ^= 0x01  # one bit inside a tensor: only a checksum can see it
    newest.write_bytes(bytes(data))
    skipped = _restore_step_4(tmp_path, reference, width=64)
    assert newest.name in skipped[0]  # the reason names the damaged file


def test_a_persistent_step_whose_metadata_names_another_key_is_skipped_for_the_older_one(tmp_path):
    """One bit flipped in a key's name in ``.metadata``: the pickle still loads, as a checkpoint of
    another state, which would be refused as a state mismatch; its seal tells it is damage."""
    reference = _save_steps_4_and_8(tmp_path)
    metadata = tmp_path / "step-8" / ".metadata"
    data = metadata.read_bytes()
    assert data.count(b"model.0.weight") == 1  # the pickle's memo names it once
    metadata.write_bytes(data.replace(b"model.0.weight", b"model.0.weighu"))
    skipped = _restore_step_4(tmp_path, reference)
    assert "checksum mismatch" in skipped[0] and ".metadata" in skipped[0], skipped


def test_a_step_directory_copied_over_a_newer_one_is_not_taken_for_it(tmp_path):
    """step-4 copied to step-8 (a sync tool, a hand-made backup): it would restore as step 8 with
    step 4's state; its ``.metadata`` records where it was saved."""
    reference = _save_steps_4_and_8(tmp_path)
    shutil.rmtree(tmp_path / "step-8")
    shutil.copytree(tmp_path / "step-4", tmp_path / "step-8")
    skipped = _restore_step_4(tmp_path, reference)
    assert "saved as step 4" in skipped[0], skipped


def test_a_run_moved_to_another_base_still_restores(tmp_path):
    reference = _save_steps_4_and_8(tmp_path / "before")
    (tmp_path / "before").rename(tmp_path / "after")
    shutil.rmtree(tmp_path / "after" / "step-8")
    restored = make_state(0)
    with TieredCheckpointManager(None, str(tmp_path / "after"), "p", **PERSISTENT_ONLY) as manager:
        assert manager.restore(restored) == 4
        assert manager.last_restore.skipped == []
    assert_same(fingerprint(restored), reference)


def _damage_every_tensor_file(step_dir: Path) -> None:
    for path in step_dir.glob("*.distcp"):
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0x01
        path.write_bytes(bytes(data))


def test_checkpoints_that_exist_but_cannot_be_restored_are_refused_not_overwritten(tmp_path):
    """Every persistent step damaged: restore raises (on a "nothing here" answer the run would
    start over and save over them), and leaves the files alone; with a local step older than the
    damaged persistent ones, that step is restored instead."""
    kwargs = {"local_every": 0, "persistent_every": 4, "keep_persistent": 2}
    state = make_state(0, width=64)
    with TieredCheckpointManager(None, str(tmp_path), "p", **kwargs) as manager:
        for step in range(1, 9):
            train_step(state, 1)
            manager.maybe_save(step, state)
    for step in (4, 8):
        _damage_every_tensor_file(tmp_path / f"step-{step}")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with TieredCheckpointManager(None, str(tmp_path), "p", **kwargs) as manager:
        with pytest.raises(CheckpointingError, match="none could be restored") as raised:
            manager.restore(make_state(0, width=64))
    assert "persistent step 8" in str(raised.value) and "persistent step 4" in str(raised.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before

    # a local tier with an older step: restored from it once every newer persistent step failed
    local, persistent = tmp_path / "local", tmp_path / "again"
    kwargs = {"local_every": 2, "persistent_every": 4, "keep_persistent": 1, "keep_local": 1}
    state, reference = make_state(0, width=64), {}
    with TieredCheckpointManager(str(local), str(persistent), "p", **kwargs) as manager:
        for step in range(1, 7):
            train_step(state, 1)
            manager.maybe_save(step, state)
            reference[step] = fingerprint(state)
        train_step(state, 1)
        manager.save(8, state, tiers="persistent")
    _damage_every_tensor_file(persistent / "step-8")
    restored = make_state(0, width=64)
    with TieredCheckpointManager(str(local), str(persistent), "p", **kwargs) as manager:
        assert manager.restore(restored) == 6
        assert manager.last_restore.tier == "local"
        assert any("persistent step 8" in s for s in manager.last_restore.skipped)
    assert_same(fingerprint(restored), reference[6])


Pair = collections.namedtuple("Pair", "generator discriminator")


def _two_models(seed: int) -> dict:
    """A GAN-like state: modules in a list, optimizers in a named tuple, a plain tuple."""
    torch.manual_seed(seed)
    models = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)]
    optimizers = Pair(*(torch.optim.AdamW(m.parameters(), lr=0.1 * (seed + 1)) for m in models))
    return {"models": models, "optimizers": optimizers, "shape": (4, "x")}


def test_modules_and_optimizers_in_lists_and_tuples_are_restored_in_place_from_each_tier(
    tmp_path, shm_dir
):
    """A list of modules and a named tuple of optimizers stay the user's objects: each gets its
    state loaded (optimizer moments and learning rates too), nothing is replaced by a state dict,
    and the named tuple stays one; the same from either tier."""
    saved = _two_models(1)
    for model, optimizer in zip(saved["models"], saved["optimizers"]):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    kwargs = {"local_every": 1, "persistent_every": 1, "replication_factor": 1}
    local, persistent = str(shm_dir / "local"), str(tmp_path / "persistent")
    with TieredCheckpointManager(local, persistent, "p", **kwargs) as manager:
        manager.maybe_save(1, saved)
    for local_dir, tier in ((local, "local"), (None, "persistent")):
        live = _two_models(0)
        models, optimizers = list(live["models"]), live["optimizers"]
        with TieredCheckpointManager(local_dir, persistent, "p", **kwargs) as manager:
            assert manager.restore(live) == 1 and manager.last_restore.tier == tier
        assert live["models"] == models and all(a is b for a, b in zip(live["models"], models))
        assert type(live["optimizers"]) is Pair and live["optimizers"] == optimizers
        assert live["shape"] == (4, "x")
        for model, optimizer, reference in zip(models, optimizers, saved["optimizers"]):
            assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
            assert len(optimizer.state) == 2
            for param, ref in zip(model.parameters(), reference.param_groups[0]["params"]):
                assert torch.equal(param, ref)
                assert torch.equal(
                    optimizer.state[param]["exp_avg"], reference.state[ref]["exp_avg"]
                )


def test_a_checkpoint_saved_before_the_first_optimizer_step_restores_from_each_tier(
    tmp_path, shm_dir
):
    """A save at step 0 (before any optimizer step) leaves the optimizer as it is (a zero step
    would count: Adam's bias correction would change) and holds no optimizer state; a fresh job,
    whose optimizer is given a state to load into, restores it from either tier with the state
    left empty, so the next step is what it would have been without the checkpoint."""
    kwargs = {"local_every": 1, "persistent_every": 1, "replication_factor": 1}
    local, persistent = str(shm_dir / "local"), str(tmp_path / "persistent")
    saved = make_state(0)
    with TieredCheckpointManager(local, persistent, "p", **kwargs) as manager:
        manager.save(0, saved)
    assert len(saved["optimizer"].state) == 0
    train_step(saved, 1)
    expected = [p.detach().clone() for p in saved["model"].parameters()]
    for local_dir, tier in ((local, "local"), (None, "persistent")):
        live = make_state(0)
        with TieredCheckpointManager(local_dir, persistent, "p", **kwargs) as manager:
            assert manager.restore(live) == 0 and manager.last_restore.tier == tier
        assert len(live["optimizer"].state) == 0
        train_step(live, 1)
        assert all(torch.equal(p, e) for p, e in zip(live["model"].parameters(), expected))


def _grouped(split: int | None) -> dict:
    """A model whose AdamW has one group, or two split after ``split`` parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    params = list(model.parameters())
    groups = [{"params": params}] if split is None else [
        {"params": params[:split]}, {"params": params[split:], "weight_decay": 0.0}
    ]  # fmt: skip
    optimizer = torch.optim.AdamW(groups, lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


def test_optimizer_groups_that_differ_are_refused_before_anything_is_loaded(tmp_path, shm_dir):
    """Parameters split into other groups, or another number of groups: StateMismatchError from
    either tier naming the optimizer, with the model and the optimizer left as they were (the
    optimizer's own load_state_dict would refuse only after the model had been overwritten)."""
    kwargs = {"local_every": 1, "persistent_every": 1, "replication_factor": 1}
    local, persistent = str(shm_dir / "local"), str(tmp_path / "persistent")
    saved = _grouped(2)
    for p in saved["model"].parameters():
        p.data.add_(1.0)
    with TieredCheckpointManager(local, persistent, "p", **kwargs) as manager:
        manager.maybe_save(1, saved)
    for split in (1, None):
        for local_dir in (local, None):
            live = _grouped(split)
            before = [p.detach().clone() for p in live["model"].parameters()]
            moments = [s["exp_avg"].clone() for s in live["optimizer"].state.values()]
            with TieredCheckpointManager(local_dir, persistent, "p", **kwargs) as manager:
                with pytest.raises(StateMismatchError, match="optimizer: optimizer parameter gr"):
                    manager.restore(live)
            assert all(torch.equal(p, b) for p, b in zip(live["model"].parameters(), before))
            after = [s["exp_avg"] for s in live["optimizer"].state.values()]
            assert all(torch.equal(a, b) for a, b in zip(after, moments))


def _rewrapped(rank: int, world: int, root: Path) -> dict:
    """Saved with ``seen`` plain and ``position`` in RankLocal; restored from the persistent tier
    with the wrapping the other way round."""
    kwargs = {"persistent_every": 1}
    saved = {"w": torch.ones(2), "seen": 7, "position": RankLocal(10 + rank)}
    with TieredCheckpointManager(None, str(root), "p", **kwargs) as manager:
        manager.maybe_save(1, saved)
    live = {"w": torch.zeros(2), "seen": RankLocal(0), "position": -1}
    with TieredCheckpointManager(None, str(root), "p", **kwargs) as manager:
        step = manager.restore(live)
    return {"step": step, "seen": live["seen"].value, "position": live["position"]}


def test_a_value_wrapped_in_rank_local_since_the_save_or_no_longer_restores(tmp_path):
    """Following the replica check's advice (wrap what differs between ranks in RankLocal), or
    undoing it, does not make the persistent checkpoint unloadable: a newly wrapped value gets the
    one stored copy on every rank, a no longer wrapped one each rank's own copy."""
    results = run_ranks(_rewrapped, 2, tmp_path, timeout=120)
    assert results == [{"step": 1, "seen": 7, "position": 10 + rank} for rank in range(2)]


def test_plain_values_under_int_keys_restore_from_each_tier(tmp_path, shm_dir):
    """Per-epoch counters keyed by int (``{0: 5}``, ``{"seen": {3: 7}}``): the persistent tier
    stores the key 3 as "3" and left the live values as they were, silently."""
    saved = {"w": torch.ones(2), 0: 5, "seen": {3: 7, "by_shard": {1: "done"}}}
    kwargs = {"local_every": 1, "persistent_every": 1, "replication_factor": 1}
    local, persistent = str(shm_dir / "local"), str(tmp_path / "persistent")
    with TieredCheckpointManager(local, persistent, "p", **kwargs) as manager:
        manager.maybe_save(1, saved)
    for local_dir, tier in ((local, "local"), (None, "persistent")):
        live = {"w": torch.zeros(2), 0: 0, "seen": {3: 0, "by_shard": {1: "new"}}}
        with TieredCheckpointManager(local_dir, persistent, "p", **kwargs) as manager:
            assert manager.restore(live) == 1 and manager.last_restore.tier == tier
        assert live == {"w": live["w"], 0: 5, "seen": saved["seen"]}
        assert live["w"].tolist() == [1.0, 1.0]


def _save_local_only(rank: int, world: int, root: Path) -> None:
    node = as_node(rank)
    state = make_state(rank)
    with TieredCheckpointManager(str(root / f"node{node}"), None, "job", local_every=2) as manager:
        assert manager.restore(state) is None
        for step in range(1, 5):
            train_step(state, world)
            manager.maybe_save(step, state)


def _restore_at_another_world_size(rank: int, world: int, root: Path) -> str:
    node = as_node(rank, ranks_per_node=1)
    with TieredCheckpointManager(str(root / f"node{node}"), None, "job", local_every=2) as manager:
        with pytest.raises(CheckpointingError, match="none could be restored") as raised:
            manager.restore(make_state(rank))
    return str(raised.value)


def test_local_steps_of_another_world_size_are_refused_not_started_over(shm_dir):
    """A job of 2 nodes x 2 ranks with the local tier only, restarted on 2 ranks (a node short):
    the local tier does not reshard, so nothing can be restored; the restore says so on every rank
    rather than answer "nothing to restore" (the run would start from step 0, and its first save
    would remove the 4-rank checkpoints from the directories it shares with them)."""
    run_ranks(_save_local_only, 4, shm_dir)
    before = {p: p.read_bytes() for p in shm_dir.rglob("*.safetensors")}
    messages = run_ranks(_restore_at_another_world_size, 2, shm_dir)
    assert all("local step 4: saved with world size 4, this job has 2 ranks" in m for m in messages)
    # rank 1 runs on node 1, whose directories are ranks 2's and 3's: more ranks, not moved ones
    assert all("saved by a job with more ranks" in m for m in messages), messages[0]
    assert not any("the ranks of a node changed" in m for m in messages), messages[0]
    assert {p: p.read_bytes() for p in shm_dir.rglob("*.safetensors")} == before


def _restore_while_the_local_load_times_out(rank: int, world: int, root: Path) -> str:
    from tierpoint.errors import CoordinationTimeoutError
    from tierpoint.local import LocalCheckpointManager

    node = as_node(rank)
    state = make_state(rank)
    with _manager(root, node) as manager:
        for step in range(1, 5):
            train_step(state, world)
            manager.maybe_save(step, state)

    def stuck(self, **kwargs):
        raise CoordinationTimeoutError("loading local checkpoint: no word from rank 1 (stopped)")

    LocalCheckpointManager.load = stuck
    with _manager(root, node) as manager:
        with pytest.raises(CoordinationTimeoutError, match="no word from rank 1") as raised:
            manager.restore(make_state(rank))
    return type(raised.value).__name__


def test_a_coordination_timeout_in_the_local_load_is_raised_not_skipped(tmp_path):
    """A rank stopped during the local load: the restore raises the CoordinationTimeoutError, as it
    does in the persistent tier, rather than skipping to the persistent steps (whose collectives
    wait for the stopped rank too) and reporting the checkpoints as unrestorable."""
    assert (
        run_ranks(_restore_while_the_local_load_times_out, 2, tmp_path)
        == ["CoordinationTimeoutError"] * 2
    )


def _save_cliques_on_one_node(rank: int, world: int, root: Path) -> None:
    node = as_node(rank)
    state = make_state(rank)
    kwargs = {"local_every": 2, "keep_local": 2, "replication_jump": 1}  # copies on the same node
    with TieredCheckpointManager(str(root / f"node{node}"), None, "job", **kwargs) as manager:
        for step in range(1, 5):
            train_step(state, world)
            manager.maybe_save(step, state)


def _restore_after_a_loss(rank: int, world: int, root: Path) -> str:
    """Node 1 lost: both copies of the parts of its ranks were on it."""
    node = as_node(rank)
    dist.barrier()
    if rank == 0:
        wipe(root / "node1")
    dist.barrier()
    kwargs = {"local_every": 2, "keep_local": 2, "replication_jump": 1}
    with TieredCheckpointManager(str(root / f"node{node}"), None, "job", **kwargs) as manager:
        with pytest.raises(CheckpointingError, match="none could be restored") as raised:
            manager.restore(make_state(rank))
    return str(raised.value)


def test_local_checkpoints_that_existed_are_not_taken_for_none(shm_dir):
    """A whole clique lost (both copies on the lost node): restore answered None, and the run
    started over and removed the parts left; it now refuses, saying why. (Nodes back with each
    other's ranks restore: tests/local/test_misplaced.py.)"""
    run_ranks(_save_cliques_on_one_node, 4, shm_dir)
    before = sorted(p.name for p in (shm_dir / "node0").rglob("*.safetensors"))
    messages = run_ranks(_restore_after_a_loss, 4, shm_dir)
    why = "local steps 2, 4: the parts of some ranks"
    assert all(why in m for m in messages), messages[0]
    assert sorted(p.name for p in (shm_dir / "node0").rglob("*.safetensors")) == before


def _first_save(rank: int, world: int, root: Path) -> None:
    as_node(rank)
    state = make_state(rank)
    with TieredCheckpointManager(str(root / "node0"), None, "job", local_every=2) as manager:
        train_step(state, world)
        manager.maybe_save(2, state)


def _restore_on_node0(rank: int, world: int, root: Path) -> object:
    as_node(rank)
    with TieredCheckpointManager(str(root / "node0"), None, "job", local_every=2) as manager:
        return manager.restore(make_state(rank))


def test_a_first_save_interrupted_before_every_part_was_in_place_starts_over(shm_dir):
    """One node, its first local save killed after rank 0's part was renamed into place but before
    rank 1's: no checkpoint existed, so the restart starts over; rank 0's part in its own directory
    is not taken for a sign that the node's ranks changed."""
    run_ranks(_first_save, 2, shm_dir)
    for part in (shm_dir / "node0" / "job" / "1").iterdir():
        part.unlink()
    assert run_ranks(_restore_on_node0, 2, shm_dir) == [None, None]


def _save_two_steps(rank: int, world: int, root: Path) -> None:
    as_node(rank)
    state = make_state(rank)
    kwargs = {"local_every": 2, "keep_local": 2}
    with TieredCheckpointManager(str(root / "node0"), None, "job", **kwargs) as manager:
        for step in (2, 4):
            train_step(state, world)
            manager.maybe_save(step, state)


def _restore_and_say_why(rank: int, world: int, root: Path) -> tuple:
    as_node(rank)
    kwargs = {"local_every": 2, "keep_local": 2}
    with TieredCheckpointManager(str(root / "node0"), None, "job", **kwargs) as manager:
        step = manager.restore(make_state(rank))
        return step, manager.last_restore.skipped


def test_a_newer_local_step_left_incomplete_is_named_in_the_restore_record(shm_dir):
    """Step 4's save killed before rank 1's part was in place: step 2 restores, and the record
    says why step 4 did not (it was said only in the log)."""
    run_ranks(_save_two_steps, 2, shm_dir)
    for part in (shm_dir / "node0" / "job" / "1").glob("*0000004*"):
        part.unlink()
    for step, skipped in run_ranks(_restore_and_say_why, 2, shm_dir):
        assert step == 2
        assert skipped == ["local step 4: incomplete (no copy of the parts of ranks 1 anywhere)"]


def _killed_after_commit(base: str, options: dict | None) -> tuple[dict, dict]:
    """Persistent steps 4 and 8 saved, then step 8 left as a save killed between its commit and
    its clean-up leaves it: ``.metadata`` written, the markers of ranks 0 and 1 still there."""
    from tierpoint import dcp, storage

    kwargs = {"local_every": 0, "persistent_every": 4, "storage_options": options}
    state, reference = make_state(0), {}
    with TieredCheckpointManager(None, base, "p", **kwargs) as manager:
        for step in range(1, 9):
            train_step(state, 1)
            manager.maybe_save(step, state)
            reference[step] = fingerprint(state)
    for rank in (0, 1):
        storage.touch(
            storage.join(dcp.step_path(base, 8), f".unfinished-{rank}"), storage_options=options
        )
    restored = make_state(0)
    with TieredCheckpointManager(None, base, "p", **kwargs) as manager:
        assert manager.restore(restored) == 4
        record = manager.last_restore
    assert_same(fingerprint(restored), reference[4])
    return record, reference


def _names_the_unfinished_step(record) -> None:
    assert record.tier == "persistent"
    assert len(record.skipped) == 1, record.skipped
    reason = record.skipped[0]
    assert "persistent step 8" in reason and "unfinished" in reason and "0, 1" in reason


def test_a_persistent_step_killed_between_its_commit_and_clean_up_is_named_when_skipped(tmp_path):
    """It has a ``.metadata`` (it looks like a checkpoint) but is not complete: the older step
    loads, and ``last_restore`` says why the newer one did not."""
    record, _ = _killed_after_commit(str(tmp_path), None)
    _names_the_unfinished_step(record)


def test_a_step_killed_between_its_commit_and_clean_up_on_s3_is_named_when_skipped(s3_bucket):  # noqa: F811
    bucket, options = s3_bucket
    record, _ = _killed_after_commit(f"{bucket}/run", options)
    _names_the_unfinished_step(record)


def test_an_unfinished_step_older_than_a_step_that_fails_to_load_is_named_too(tmp_path):
    """Steps 4, 8 and 12 saved; 8 killed between its commit and its clean-up, 12 damaged: step 4
    loads, and ``last_restore`` names both newer steps, 8 too (not only those newer than 12)."""
    from tierpoint import dcp, storage

    base = str(tmp_path)
    kwargs = {"local_every": 0, "persistent_every": 4}
    state = make_state(0)
    with TieredCheckpointManager(None, base, "p", **kwargs) as manager:
        for step in range(1, 13):
            train_step(state, 1)
            manager.maybe_save(step, state)
    storage.touch(storage.join(dcp.step_path(base, 8), ".unfinished-0"))
    for name in os.listdir(dcp.step_path(base, 12)):
        if name.endswith(".distcp"):
            with open(os.path.join(dcp.step_path(base, 12), name), "r+b") as f:
                f.seek(100)
                byte = f.read(1)[0]
                f.seek(100)
                f.write(bytes([byte ^ 0xFF]))
    with TieredCheckpointManager(None, base, "p", **kwargs) as manager:
        assert manager.restore(make_state(0)) == 4
        skipped = manager.last_restore.skipped
    assert [reason.split(":")[0] for reason in skipped] == [
        "persistent step 8",
        "persistent step 12",
    ]


def test_a_persistent_step_the_store_cannot_serve_fails_the_restore_rather_than_rewind(
    s3_bucket,  # noqa: F811
    faulty_endpoint,  # noqa: F811
):
    """The store lists step 8 but stops serving its objects: restoring step 4 instead would throw
    away the steps since and save over step 8 later. The restore fails, naming the store; once the
    store serves again, step 8 restores."""
    base, options = s3_bucket
    kwargs = {**PERSISTENT_ONLY, "storage_options": options}
    state = make_state(0)
    with TieredCheckpointManager(None, base, "p", **kwargs) as manager:
        for step in range(1, 9):
            train_step(state, 1)
            manager.maybe_save(step, state)
    reference = fingerprint(state)
    endpoint = faulty_endpoint(failing_reads="/step-8/")
    through = {**kwargs, "storage_options": {"endpoint_url": endpoint.url}}
    with TieredCheckpointManager(None, base, "p", **through) as manager:
        with pytest.raises(StorageUnavailableError, match="step-8"):
            manager.restore(make_state(0))
    restored = make_state(0)
    with TieredCheckpointManager(None, base, "p", **kwargs) as manager:
        assert manager.restore(restored) == 8
    assert_same(fingerprint(restored), reference)


def _restore_while_the_store_cannot_list(
    rank: int, world: int, root: Path, base: str, options: dict, unlisted: str
) -> tuple[str, str]:
    """Local step 4 and persistent step 8, then a restore through an endpoint that cannot list
    the bucket; returns what the restore raised (class and message) or restored."""
    as_node(rank, world)  # one node: no replicas
    state, local = make_state(rank), str(root / "local")
    with TieredCheckpointManager(local, None, "job", local_every=4) as manager:
        for step in range(1, 5):
            train_step(state, world)
            manager.maybe_save(step, state)
    with TieredCheckpointManager(
        None, base, "job", **PERSISTENT_ONLY, storage_options=options
    ) as manager:
        for step in range(5, 9):
            train_step(state, world)
            manager.maybe_save(step, state)
    through = {"local_every": 4, "persistent_every": 4, "storage_options": unlisted}
    with TieredCheckpointManager(local, base, "job", **through) as manager:
        try:
            step = manager.restore(make_state(rank))
        except CheckpointingError as e:
            return type(e).__name__, str(e)
        return "restored", f"step {step} from {manager.last_restore.tier}"


def test_a_persistent_tier_the_store_cannot_list_fails_the_restore_rather_than_rewind(
    s3_bucket,  # noqa: F811
    faulty_endpoint,  # noqa: F811
    shm_dir,
):
    """The store does not answer the listing: the persistent steps are unknown, and the local
    tier's step 4 is older than persistent step 8. Restoring it would rewind the run (and its
    next saves would go beside step 8); every rank raises instead (before: step 4 restored)."""
    base, options = s3_bucket
    endpoint = faulty_endpoint(failing_reads="/" + base.removeprefix("s3://"))
    unlisted = {"endpoint_url": endpoint.url}
    outs = run_ranks(
        _restore_while_the_store_cannot_list, 2, shm_dir, base, options, unlisted, timeout=240
    )
    for kind, message in outs:
        assert kind == "StorageUnavailableError", message
        assert "cannot list" in message and "did not answer" in message, message


def test_a_persistent_tier_that_cannot_be_listed_is_named_not_taken_for_checkpoints(
    s3_server,  # noqa: F811
):
    """A bucket that does not exist (a typo, or not made yet): the restore refuses, saying the
    tier cannot be listed and what to do; it said that checkpoints existed and to move them away."""
    url = "s3://tierpoint-no-such-bucket/run"
    options = {"endpoint_url": s3_server}
    with TieredCheckpointManager(None, url, "p", **PERSISTENT_ONLY, storage_options=options) as m:
        with pytest.raises(CheckpointingError) as raised:
            m.restore(make_state(0))
    message = str(raised.value)
    assert f"cannot list {url}" in message and "does not exist" in message, message
    assert "whether checkpoints exist there is unknown" in message, message
    assert "checkpoints exist but" not in message and "move them away" not in message, message


def _save_on_two_nodes(rank: int, world: int, root: Path) -> dict:
    node = as_node(rank, ranks_per_node=1)
    state = make_state(rank)
    kwargs = {"local_every": 2, "persistent_every": 2}
    with TieredCheckpointManager(str(root / f"node{node}"), str(root / "p"), "job", **kwargs) as m:
        for step in range(1, 5):
            train_step(state, world)
            m.maybe_save(step, state)
    torch.save(fingerprint(state), root / f"saved{rank}.pt")


def _go_on_with_three_nodes(rank: int, world: int, root: Path) -> list:
    node = as_node(rank, ranks_per_node=1)
    records = WarningRecords()
    state = make_state(rank)
    kwargs = {"local_every": 2, "persistent_every": 2}
    with TieredCheckpointManager(str(root / f"node{node}"), str(root / "p"), "job", **kwargs) as m:
        step, tier = m.restore(state), m.last_restore.tier
        saved = torch.load(root / f"saved{rank if rank < 2 else 0}.pt")  # new ranks take rank 0's
        assert_same(fingerprint(state), saved)
        m.maybe_save(6, state)
    again = make_state(rank)
    with TieredCheckpointManager(str(root / f"node{node}"), str(root / "p"), "job", **kwargs) as m:
        resumed = [m.restore(again), m.last_restore.tier]
    return [step, tier, resumed, records.messages]


@pytest.mark.slow
def test_a_job_back_on_three_nodes_runs_unreplicated_rather_than_refusing(shm_dir):
    """Two copies of each local part cannot be spread over 3 nodes of one rank each (a job
    restarted with another node, or with one of 4 lost): the manager warns and saves its local
    tier unreplicated instead of refusing to start, so the job reaches its persistent step."""
    run_ranks(_save_on_two_nodes, 2, shm_dir)
    results = run_ranks(_go_on_with_three_nodes, 3, shm_dir)
    assert [r[:3] for r in results] == [[4, "persistent", [6, "local"]]] * 3
    warned = [m for m in results[0][3] if "local checkpoints are not replicated" in m]
    assert warned and "3 ranks on 3 nodes do not form cliques of 2" in warned[0], results[0][3]


def _lose_the_persistent_copy(root: Path, rank: int, step: int) -> None:
    """As if the job died before the persistent copy of ``step`` was committed."""
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root / "persistent" / f"step-{step}")
    dist.barrier()


def _copy_lost_with_the_job(rank: int, world: int, root: Path) -> dict:
    state = make_state(rank)
    with _manager(root, rank) as manager:
        for step in range(1, 5):  # step 4: local, then its persistent copy from the local part
            train_step(state, world)
            manager.maybe_save(step, state)
    _lose_the_persistent_copy(root, rank, 4)
    out = {}
    for run in ("copy lost", "copy kept"):
        with _manager(root, rank) as manager:
            out[run] = [manager.restore(make_state(rank)), manager.last_restore.tier]
            out[run].append(manager.maybe_save(5, state))
        dist.barrier()
        out[run].append(sorted(os.listdir(root / "persistent")))
    return out


def test_a_persistent_copy_lost_with_the_job_is_made_up_for_by_the_next_step(tmp_path):
    """The persistent copy of step 4 is made from its local part after the local save; a job that
    died first left the persistent tier at nothing. Resumed from the local tier, the next step (5,
    not scheduled for any tier) goes to the persistent tier; once it holds a step as new as the
    last one due, nothing is owed."""
    for out in run_ranks(_copy_lost_with_the_job, 2, tmp_path, timeout=200):
        assert out["copy lost"] == [4, "local", ("persistent",), ["step-5"]], out
        assert out["copy kept"][:3] == [5, "persistent", ()], out  # nothing owed any more


def _owed_or_not(rank: int, world: int, root: Path) -> list:
    state = make_state(rank)
    with _manager(root, rank) as manager:  # local step 2; the first persistent step is 4
        for step in range(1, 3):
            train_step(state, world)
            manager.maybe_save(step, state)
    with _manager(root, rank) as manager:
        out = [manager.restore(state), manager.last_restore.tier, manager.maybe_save(3, state)]
        for step in range(4, 7):  # local steps 4 and 6, the persistent copy of step 4
            train_step(state, world)
            manager.maybe_save(step, state)
    _lose_the_persistent_copy(root, rank, 4)
    records = WarningRecords()
    with _manager(root, rank) as manager:
        out += [manager.restore(state), manager.maybe_save(7, state)]
    return [*out, [m for m in records.messages if "to the persistent tier (" in m]]


def test_what_is_owed_to_the_persistent_tier_is_its_last_step_due(tmp_path):
    """Restored from local step 2 with persistent saves every 4 steps and none there: step 3 goes
    to the persistent tier too (a loop from 0 saved step 0 there: its copy may have died with the
    job). Restored from local step 6 with the copy of step 4 lost: step 7 makes up for it, named
    as step 4's (it was named as the step restored)."""
    for out in run_ranks(_owed_or_not, 2, tmp_path, timeout=200):
        assert out[:5] == [2, "local", ("persistent",), 6, ("persistent",)], out
        assert out[5] == [
            "saving step 7 to the persistent tier (the persistent copy of step 4 was not made)"
        ], out


def _local_step_between_persistent_ones(rank: int, world: int, root: Path) -> tuple:
    """Local steps 4 and 6, persistent steps 4 and 8 (step 8 saved to the persistent tier
    alone, as a final save does), then step 8 damaged: the restore must take local step 6."""
    node = as_node(rank, ranks_per_node=1)
    state = make_state(rank)
    with _manager(root, node, keep_persistent=3) as manager:
        for step in range(1, 8):
            train_step(state, world)
            manager.maybe_save(step, state)
            if step == 6:
                reference = fingerprint(state)
        train_step(state, world)
        manager.wait()
        manager.save(8, state, tiers="persistent")
    dist.barrier()
    if rank == 0:
        _damage_every_tensor_file(root / "persistent" / "step-8")
    dist.barrier()
    restored = make_state(rank)
    with _manager(root, node, keep_persistent=3) as manager:
        step = manager.restore(restored)
        record = manager.last_restore
    assert_same(fingerprint(restored), reference)
    return step, record.tier, record.skipped


def test_a_local_step_newer_than_the_persistent_step_loaded_instead_is_restored(shm_dir):
    """The newest persistent step fails to load: the local tier's step 6, older than it but newer
    than the next persistent step (4), is restored, not persistent step 4 (the local step was
    tried only once every persistent step had failed)."""
    for step, tier, skipped in run_ranks(_local_step_between_persistent_ones, 2, shm_dir):
        assert (step, tier) == (6, "local")
        assert len(skipped) == 1 and "persistent step 8" in skipped[0], skipped
