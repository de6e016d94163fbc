"""DTensors in the local tier: each rank's part holds its local shard and how it was sharded; a load
rebuilds the DTensors on the same mesh (2 gloo ranks, a 1-D CPU DeviceMesh, FSDP2 and
distribute_tensor)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tierpoint import fileformat
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.errors import CheckpointingError
from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager
from tierpoint.testing import run_ranks


def _training_state(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    # 5 rows on 2 ranks: uneven shards (3 and 2 rows)
    table = distribute_tensor(torch.arange(15.0).reshape(5, 3) * (seed + 1), mesh, [Shard(0)])
    bias = distribute_tensor(torch.full((3,), float(seed)), mesh, [Replicate()])
    return model, optimizer, {"table": table, "bias": bias, "step": seed}


def _full(state: dict) -> dict:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def _save(rank: int, world: int, root: str) -> list:
    model, optimizer, extra = _training_state(world, seed=1)
    manager = LocalCheckpointManager(root, session_id="dt")
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), **extra}
    manager.save(BasicTensorAwareStateDict(state), 1)
    with AsyncCallsQueue() as queue:
        request = manager.save(BasicTensorAwareStateDict(state), 2, is_async=True)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    ta, _ = manager.load()  # in the process that saved (its mesh is reused)
    assert isinstance(ta.state_dict["table"], DTensor)
    return [
        {k: v.tolist() for k, v in _full(model.state_dict()).items()},
        _full(extra)["table"].tolist(),
    ]


def _resume(rank: int, world: int, root: str) -> list:
    model, optimizer, extra = _training_state(world, seed=5)  # a fresh job, other values
    ta, ckpt_id = LocalCheckpointManager(root, session_id="dt").load()
    loaded = ta.state_dict
    assert ckpt_id.iteration == 2 and loaded["step"] == 1
    table = loaded["table"]
    assert isinstance(table, DTensor) and table.placements == (Shard(0),)
    assert table.to_local().shape == (3 - rank, 3)
    assert table.device_mesh == extra["table"].device_mesh
    # Any rank checks any rank's part (as replication does on receipt) without its mesh.
    other = LocalCheckpointManager(root, session_id="dt")._store.dir_of(1 - rank)
    fileformat.verify(next(other.glob("iter_0000002_*")))
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optim"])
    # The description is checked against the shard before anything is built.
    from tierpoint import dtensors
    from tierpoint.tree import SkeletonError

    desc = dtensors.describe(table, "table")
    with pytest.raises(SkeletonError, match="local shard is \\[4, 3\\]"):
        dtensors.rebuild(torch.zeros(4, 3), desc)
    with pytest.raises(SkeletonError, match="unknown DTensor placement"):
        dtensors.rebuild(table.to_local(), {**desc, "placements": [["strided", 0]]})
    with pytest.raises(SkeletonError, match="not a set of distinct ranks below 2"):
        dtensors.rebuild(table.to_local(), {**desc, "mesh": [0, 5]})
    return [
        {k: v.tolist() for k, v in _full(model.state_dict()).items()},
        _full(loaded)["table"].tolist(),
    ]


def test_dtensor_states_round_trip_through_the_local_tier(tmp_path):
    saved = run_ranks(_save, 2, str(tmp_path))
    assert saved[0] == saved[1]
    assert run_ranks(_resume, 2, str(tmp_path)) == saved


def test_a_dtensor_part_needs_torch_distributed_to_load(tmp_path):
    from tierpoint import dtensors

    with pytest.raises(CheckpointingError, match="needs torch.distributed initialised"):
        dtensors.rebuild(
            torch.zeros(2),
            {
                "device_type": "cpu",
                "mesh": [0, 1],
                "shape": [4],
                "stride": [1],
                "placements": [["shard", 0]],
            },
        )
