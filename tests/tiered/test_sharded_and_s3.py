"""The tiered manager with FSDP2 (``fully_shard``) state on 2 ranks, both tiers, and with its
persistent tier on the local S3-compatible server."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tests.dcp.s3_server import s3_bucket, s3_server  # noqa: F401 - pytest fixtures
from tierpoint import TieredCheckpointManager, storage
from tierpoint.testing import run_ranks

from .helpers import assert_same, fingerprint, make_state, train_step


def _fsdp_state(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": optimizer, "step": 0}


def _fsdp_step(state: dict, step: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
    state["optimizer"].zero_grad()
    state["model"](x).pow(2).mean().backward()
    state["optimizer"].step()
    state["step"] = step


def _shards(state: dict) -> list[torch.Tensor]:
    opt = state["optimizer"].state_dict()["state"]
    tensors = list(state["model"].state_dict().values())
    tensors += [v for s in opt.values() for v in s.values()]
    return [t.to_local().clone() if hasattr(t, "to_local") else t.clone() for t in tensors]


def _fsdp(rank: int, world: int, root: Path) -> list:
    state = _fsdp_state(rank)
    reference = {}
    kwargs = {"local_every": 2, "persistent_every": 4}
    with TieredCheckpointManager(str(root / "local"), str(root / "p"), "f", **kwargs) as manager:
        for step in range(1, 7):
            _fsdp_step(state, step)
            manager.maybe_save(step, state)
            reference[step] = _shards(state)
    out = []
    for wipe_local in (False, True):
        if wipe_local:
            dist.barrier()
            if rank == 0:
                shutil.rmtree(root / "local")
            dist.barrier()
        restored = _fsdp_state(rank)
        with TieredCheckpointManager(str(root / "local"), str(root / "p"), "f", **kwargs) as m:
            step = m.restore(restored)
            out.append([step, m.last_restore.tier, restored["step"]])
        got = _shards(restored)
        assert len(got) == len(reference[step])
        assert all(torch.equal(a, b) for a, b in zip(got, reference[step]))
        _fsdp_step(restored, step + 1)  # and training goes on from it
    return out


def test_fsdp2_state_restores_its_shards_from_both_tiers(tmp_path):
    for out in run_ranks(_fsdp, 2, tmp_path, timeout=200):
        assert out == [[6, "local", 6], [4, "persistent", 4]]


def _plain_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2), "step": 0}


def _fsdp_then_plain(rank: int, world: int, root: Path) -> list:
    kwargs = {"local_every": 2, "persistent_every": 4}
    state = _fsdp_state(rank)
    with TieredCheckpointManager(str(root / "local"), str(root / "p"), "f", **kwargs) as manager:
        for step in range(1, 7):
            _fsdp_step(state, step)
            manager.maybe_save(step, state)
            if step == 4:
                saved = _full(state)
    plain = _plain_state()  # the same model, unsharded (FSDP to DDP): local step 6 holds shards
    with TieredCheckpointManager(str(root / "local"), str(root / "p"), "f", **kwargs) as manager:
        step = manager.restore(plain)
        record = manager.last_restore
        equal = all(np.array_equal(a, b) for a, b in zip(_full(plain), saved, strict=True))
        for again in (5, 6):  # step 6 again, in the new layout: the old one is not in the way
            _fsdp_step(plain, again)
            manager.maybe_save(again, plain)
    with TieredCheckpointManager(str(root / "local"), str(root / "p"), "f", **kwargs) as manager:
        resumed = [manager.restore(_plain_state()), manager.last_restore.tier]
    return [step, record.tier, plain["step"] >= 4, equal, record.skipped, resumed]


def test_a_local_step_of_another_parallel_layout_gives_way_to_the_persistent_tier(tmp_path):
    """FSDP2 shards in the local tier cannot fill an unsharded model: the restore skips them for
    the persistent step, which torch DCP reshards, and the next save replaces them."""
    for step, tier, stepped, equal, skipped, resumed in run_ranks(
        _fsdp_then_plain, 2, tmp_path, timeout=200
    ):
        assert (step, tier, stepped, equal) == (4, "persistent", True, True)
        assert any("local step 6: saved in another parallel layout" in s for s in skipped), skipped
        assert resumed == [6, "local"]


def _fsdp_then_grown(rank: int, world: int, root: Path) -> str:
    state = _fsdp_state(rank)
    with TieredCheckpointManager(str(root / "local"), None, "g", local_every=2) as manager:
        _fsdp_step(state, 2)
        manager.maybe_save(2, state)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model.append(torch.nn.Linear(4, 4))  # another model, sharded alike: not another layout
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    grown = {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "step": 0}
    with TieredCheckpointManager(str(root / "local"), None, "g", local_every=2) as manager:
        try:
            manager.restore(grown)
        except Exception as e:  # noqa: BLE001 - its class and text are what is checked
            return f"{type(e).__name__}: {e}"
    return "restored"


def test_a_local_step_of_another_model_is_a_state_mismatch_not_another_layout(tmp_path):
    """A model grown by a layer has DTensors the checkpoint lacks, so its shardings differ too:
    the restore said "saved in another parallel layout" (a CheckpointingError) instead of the
    StateMismatchError naming the missing parameters."""
    for error in run_ranks(_fsdp_then_grown, 2, tmp_path, timeout=200):
        assert error.startswith("StateMismatchError") and "not in the checkpoint: 3.weight" in error


def _on_s3(rank: int, world: int, root: Path, base: str, options: dict) -> list:
    state = make_state(rank)
    kwargs = {"local_every": 2, "persistent_every": 2, "keep_persistent": 2}
    local = str(root / "local")
    events: list = []
    with TieredCheckpointManager(
        local, base, "s3", storage_options=options, on_event=events.append, **kwargs
    ) as manager:
        for step in range(1, 7):
            train_step(state, world)
            manager.maybe_save(step, state)
    reference = fingerprint(state)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(local)
    dist.barrier()
    restored = make_state(rank)
    with TieredCheckpointManager(local, base, "s3", storage_options=options, **kwargs) as manager:
        step = manager.restore(restored)
        tier = manager.last_restore.tier
    assert_same(fingerprint(restored), reference)
    saved = [(e["tier"], e["step"], e["ok"], e["error"]) for e in events]
    return [step, tier, storage.listdir(base, options), saved]


def test_the_persistent_tier_on_s3_restores_and_keeps_the_newest_steps(tmp_path, s3_bucket):  # noqa: F811
    bucket, options = s3_bucket
    for out in run_ranks(_on_s3, 2, tmp_path, f"{bucket}/run", options, timeout=250):
        assert out[:3] == [6, "persistent", ["step-4", "step-6"]], out


def _full(state: dict) -> list:
    """Every parameter and optimizer tensor, whole, as numpy arrays (returned by value)."""
    opt = state["optimizer"].state_dict()["state"]
    tensors = list(state["model"].state_dict().values())
    tensors += [v for s in opt.values() for v in s.values()]
    return [(t.full_tensor() if hasattr(t, "full_tensor") else t).numpy().copy() for t in tensors]


def _fsdp_save(rank: int, world: int, root: Path) -> list:
    state = _fsdp_state(rank)
    kwargs = {"local_every": 0, "persistent_every": 3}
    with TieredCheckpointManager(None, str(root), "r", **kwargs) as manager:
        for step in range(1, 4):
            _fsdp_step(state, step)
            manager.maybe_save(step, state)
    return _full(state)


def _fsdp_restore(rank: int, world: int, root: Path) -> list:
    state = _fsdp_state(rank)
    with TieredCheckpointManager(None, str(root), "r", persistent_every=3) as manager:
        step = manager.restore(state)
    return [step, state["step"], _full(state)]


def test_fsdp2_state_saved_by_two_ranks_restores_resharded_onto_one(tmp_path):
    saved = run_ranks(_fsdp_save, 2, tmp_path, timeout=200)[0]
    ((step, value, restored),) = run_ranks(_fsdp_restore, 1, tmp_path, timeout=200)
    assert (step, value) == (3, 3)
    assert len(restored) == len(saved)
    assert all((a == b).all() and a.shape == b.shape for a, b in zip(restored, saved))
