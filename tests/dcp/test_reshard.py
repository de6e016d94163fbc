"""Resharding with tierpoint's reader: DCP checkpoints saved by 4 ranks (torch's ``dcp.save`` and
tierpoint's ``save``: DTensor shards along dim 0 and dim 1 with uneven sizes, a ShardedTensor,
replicated tensors, bfloat16 / int64 / bool, non-tensor values) load with 4, 2 and 1 rank(s) and give
exactly the full tensors back."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.collectives import CountCollectives
from tierpoint.dcp import load, read_metadata
from tierpoint.dcp import save as tierpoint_save
from tierpoint.testing import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
warnings.filterwarnings("ignore", message=".*ShardedTensor.*")

SAVE_WORLD = 4
WRITERS = ("torch", "tierpoint")
SHARD_DIM = {"cols": 1}
"""Tensors sharded along dim 1; all others along dim 0."""


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(37, 11, generator=g),  # 37 rows: uneven over 4 and 2 ranks
        "bf": torch.randn(10, 3, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-(2**40), 2**40, (13,), generator=g),
        "mask": torch.rand(9, 5, generator=g) > 0.5,
        "cols": torch.randn(6, 23, generator=g),  # sharded along columns: strided regions
        "tiny": torch.randn(3, generator=g),  # fewer rows than ranks: some shards are empty
    }


def replicated() -> dict[str, torch.Tensor]:
    return {"rep": torch.arange(50, dtype=torch.float64).reshape(5, 10)}


PLAIN = {"step": 1234, "name": "exp-α", "sched": {"lr": 0.01, "milestones": [3, 7]}}


def sharded_state(world: int, fill: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state: dict = {}
    for key, full in full_tensors().items():
        source = full if fill else torch.zeros_like(full)
        state[key] = distribute_tensor(source, mesh, [Shard(SHARD_DIM.get(key, 0))])
    for key, full in replicated().items():
        state[key] = full.clone() if fill else torch.zeros_like(full)
    if fill:
        state.update(pickle.loads(pickle.dumps(PLAIN)))
    else:
        state.update({"step": None, "name": None, "sched": {"lr": None, "milestones": None}})
    return state


def sharded_tensor(rank: int, world: int) -> torch.Tensor:
    """A ShardedTensor of 4 * world rows (torch's older sharding API), rank r holding rows 4r..4r+3."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    local = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * rank
    md = ShardMetadata([4 * rank, 0], [4, 3], f"rank:{rank}/cpu")
    return init_from_local_shards([Shard(local, md)], [4 * world, 3])


def expected_sharded_tensor() -> torch.Tensor:
    return torch.cat(
        [torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * r for r in range(SAVE_WORLD)]
    )


def check_sharded(state: dict, world: int) -> None:
    """Every DTensor holds exactly its shard of the full tensor; the rest is equal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for key, full in full_tensors().items():
        expected = distribute_tensor(full, mesh, [Shard(SHARD_DIM.get(key, 0))]).to_local()
        local = state[key].to_local()
        assert local.dtype == full.dtype and torch.equal(local, expected), key
        assert torch.equal(state[key].full_tensor(), full), key
    for key, full in replicated().items():
        assert torch.equal(state[key], full), key
    assert {k: state[k] for k in PLAIN} == PLAIN


def _save_with_4_and_reload(rank: int, world: int, base: str) -> bool:
    for writer in WRITERS:
        state = sharded_state(world, fill=True)
        path = f"{base}/{writer}"
        if writer == "torch":
            state["st"] = sharded_tensor(rank, world)
            dcp.save(state, checkpoint_id=path)
        else:
            tierpoint_save(state, path)
        target = sharded_state(world, fill=False)
        load(target, path)
        check_sharded(target, world)
    dist.barrier()
    return True


def _load_with_2(rank: int, world: int, base: str) -> list[dict[str, int]]:
    counts = []
    for writer in WRITERS:
        target = sharded_state(world, fill=False)
        if writer == "torch":
            # A ShardedTensor checkpoint loads into a plain tensor (every rank gets all of it).
            target["st"] = torch.zeros(4 * SAVE_WORLD, 3)
        with CountCollectives() as counted:
            load(target, f"{base}/{writer}", thread_count=2)
        counts.append(counted)
        check_sharded(target, world)
        if writer == "torch":
            assert torch.equal(target["st"], expected_sharded_tensor())
    dist.barrier()
    return counts


@pytest.fixture(scope="module")
def saved_by_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("reshard")
    assert run_ranks(_save_with_4_and_reload, SAVE_WORLD, str(base), timeout=240) == [True] * 4
    return base


@pytest.mark.timeout(300)
def test_saved_by_4_loads_with_4(saved_by_4: Path) -> None:
    assert {p.name for p in saved_by_4.iterdir()} == set(WRITERS)


@pytest.mark.timeout(300)
def test_saved_by_4_loads_with_2(saved_by_4: Path) -> None:
    """... and the load runs no planning collectives: each rank plans its own reads, and the
    ranks meet twice, to agree that every rank's items are sound before any rank writes into its
    state, and on the outcome (one all-reduce of a few integers each: texts are gathered only when
    a rank failed)."""
    for per_load in run_ranks(_load_with_2, 2, str(saved_by_4), timeout=240):
        for counts in per_load:
            assert counts == {
                "all_reduce": 2,
                "all_gather": 0,
                "all_gather_object": 0,
                "gather": 0,
                "gather_object": 0,
                "scatter_object_list": 0,
                "broadcast": 0,
            }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("writer", WRITERS)
def test_saved_by_4_loads_in_one_process(saved_by_4: Path, writer: str) -> None:
    """One process, no process group: the whole tensors come back (consolidation)."""
    target = {key: torch.zeros_like(t) for key, t in full_tensors().items()}
    target.update({key: torch.zeros_like(t) for key, t in replicated().items()})
    target.update({"step": None, "name": None, "sched": {"lr": None, "milestones": None}})
    if writer == "torch":
        target["st"] = torch.zeros(4 * SAVE_WORLD, 3)
    load(target, saved_by_4 / writer, thread_count=3)
    for key, full in {**full_tensors(), **replicated()}.items():
        assert target[key].dtype == full.dtype and torch.equal(target[key], full), key
    assert {k: target[k] for k in PLAIN} == PLAIN
    if writer == "torch":
        assert torch.equal(target["st"], expected_sharded_tensor())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("writer", WRITERS)
def test_sharded_metadata_reads_like_torchs(saved_by_4: Path, writer: str) -> None:
    ours = read_metadata(saved_by_4 / writer)
    theirs = pickle.loads((saved_by_4 / writer / ".metadata").read_bytes())  # our own fresh file
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data
    assert sorted(c.sizes[0] for c in ours.state_dict_metadata["w"].chunks) == [7, 10, 10, 10]
