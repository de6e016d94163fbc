"""Peer retrieval of DCP checkpoints on node-local disks (4 real gloo ranks, 2 simulated nodes).

Each node writes to its own directory; after a restart with the ranks on the other nodes, every node
lacks what its ranks read. ``retrieve_missing`` must fetch it from the peers (and plain torch DCP
must then load from the node's own directory), or report the checkpoint not viable when a file exists
nowhere.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as torch_dcp

from tierpoint import dcp
from tierpoint.dcp.peer_fetch import plan_moves, retrieve_missing
from tierpoint.testing import run_ranks

WORLD = 4


def _state(rank: int, step: int) -> dict:
    return {f"rank{rank}": torch.arange(50_000, dtype=torch.float32) * (rank + 1) + step}


def _node_dir(tmp: str, node: int, step: int) -> str:
    return os.path.join(tmp, f"node{node}", f"step-{step}")


def _save(rank: int, world: int, tmp: str) -> None:
    os.environ["TIERPOINT_NODE_ID"] = f"node{rank // 2}"
    for step in (3, 5):
        dcp.save(_state(rank, step), _node_dir(tmp, rank // 2, step))


def _restart_swapped(rank: int, world: int, tmp: str, step: int) -> tuple[bool, list[str]]:
    node = 1 - rank // 2  # ranks 0-1 now run on node 1, ranks 2-3 on node 0
    os.environ["TIERPOINT_NODE_ID"] = f"node{node}"
    step_dir = _node_dir(tmp, node, step)
    if not retrieve_missing(step_dir, timeout=60):
        return False, []
    state = {f"rank{rank}": torch.zeros(50_000)}
    torch_dcp.load(state, storage_reader=torch_dcp.FileSystemReader(step_dir))
    assert torch.equal(state[f"rank{rank}"], _state(rank, step)[f"rank{rank}"])
    return True, sorted(os.listdir(step_dir))


def test_swapped_nodes_fetch_what_they_read_then_plain_dcp_loads(tmp_path: Path) -> None:
    run_ranks(_save, WORLD, str(tmp_path))
    assert ".metadata" not in os.listdir(_node_dir(str(tmp_path), 1, 5))  # coordinator on node 0
    results = run_ranks(_restart_swapped, WORLD, str(tmp_path), 5)
    assert all(ok for ok, _ in results)
    node1 = results[0][1]  # ranks 0 and 1 now live on node 1
    assert ".metadata" in node1 and any(n.startswith("__0_") for n in node1)
    assert any(n.startswith("__1_") for n in node1)


def _latest_swapped(rank: int, world: int, tmp: str) -> str | None:
    node = 1 - rank // 2
    os.environ["TIERPOINT_NODE_ID"] = f"node{node}"
    base = os.path.join(tmp, f"node{node}")
    latest = dcp.get_latest_complete_checkpoint(base, node_local=True)
    if latest is None:
        return None
    step = int(latest.rsplit("-", 1)[1])
    state = {f"rank{rank}": torch.zeros(50_000)}
    dcp.load(state, latest)
    assert torch.equal(state[f"rank{rank}"], _state(rank, step)[f"rank{rank}"])
    return os.path.basename(latest)


def test_a_file_that_exists_nowhere_makes_the_step_not_viable(tmp_path: Path) -> None:
    run_ranks(_save, WORLD, str(tmp_path))
    lost = next(n for n in os.listdir(_node_dir(str(tmp_path), 1, 5)) if n.startswith("__3_"))
    os.unlink(os.path.join(_node_dir(str(tmp_path), 1, 5), lost))
    # get_latest_complete_checkpoint(node_local=True) skips step 5 and completes step 3 instead.
    assert run_ranks(_latest_swapped, WORLD, str(tmp_path)) == ["step-3"] * WORLD


def _replicated_key(rank: int, world: int, tmp: str) -> dict[str, list[str]]:
    """Each rank on its own node; ``w`` is held by both ranks, so torch DCP writes it once."""
    os.environ["TIERPOINT_NODE_ID"] = f"node{rank}"
    base = os.path.join(tmp, f"node{rank}")
    state = {"w": torch.arange(1000.0), f"own{rank}": torch.full((10,), float(rank))}
    dcp.save(state, dcp.step_path(base, 5))
    before = sorted(os.listdir(dcp.step_path(base, 5)))
    latest = dcp.get_latest_complete_checkpoint(base, node_local=True)
    assert latest == dcp.step_path(base, 5), latest
    loaded = {"w": torch.zeros(1000), f"own{rank}": torch.zeros(10)}
    dcp.load(loaded, latest)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(
        loaded[f"own{rank}"], state[f"own{rank}"]
    )
    return {"before": before, "after": sorted(os.listdir(latest))}


def test_a_key_every_rank_holds_is_fetched_by_every_node(tmp_path: Path) -> None:
    # torch DCP writes "w" from one rank only; the other node must fetch that rank's file too.
    results = run_ranks(_replicated_key, 2, str(tmp_path))
    writer = next(r for r in (0, 1) if any(n.startswith(f"__{r}_") for n in results[r]["before"]))
    other = 1 - writer
    assert not any(n.startswith(f"__{writer}_") for n in results[other]["before"])
    assert any(n.startswith(f"__{writer}_") for n in results[other]["after"])


def test_plan_spreads_sources_and_skips_files_a_node_has() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    required = {f"__{r}_0.distcp": 100 for r in range(6)}
    full = {**required, ".metadata": 10}
    # Node c lost everything; nodes a and b hold full copies.
    listings = [full, full, full, full, {}, {}]
    moves = plan_moves(listings, required, 10, nodes)
    assert sorted((dst, name) for _, dst, name in moves) == [
        (4, ".metadata"),
        (4, "__4_0.distcp"),
        (5, "__5_0.distcp"),
    ]
    assert len({src for src, _, _ in moves}) == 3  # three transfers from three different ranks
    # A file holding a key every rank may read (not a shard) goes to every node that lacks it.
    shared = plan_moves(listings, required, 10, nodes, shared={"__0_0.distcp"})
    assert sorted((dst, name) for _, dst, name in shared) == [
        (4, ".metadata"),
        (4, "__0_0.distcp"),
        (4, "__4_0.distcp"),
        (5, "__5_0.distcp"),
    ]
    # A truncated copy does not count; a file nobody has makes the plan impossible.
    truncated = {**full, "__4_0.distcp": 99}
    assert plan_moves([truncated] * 4 + [{}, {}], required, 10, nodes) is None


def _save_placed(
    rank: int, world: int, tmp: str, step: int, nodes: list[int], value: float, again: bool
) -> None:
    """Rank ``rank`` runs on node ``nodes[rank]``; ``again``: the step is saved into again."""
    node = nodes[rank]
    os.environ["TIERPOINT_NODE_ID"] = f"node{node}"
    state = {f"rank{rank}": torch.full((1000,), value + rank), "w": torch.full((10,), value)}
    dcp.save(state, _node_dir(tmp, node, step), overwrite=again)


def _latest_on_node(node: int, tmp: str) -> tuple[str | None, list[str]]:
    """This rank runs on ``node``: the latest checkpoint there (node-local), and the WARNINGs
    logged meanwhile."""
    os.environ["TIERPOINT_NODE_ID"] = f"node{node}"
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tierpoint").addHandler(handler)
    latest = dcp.get_latest_complete_checkpoint(os.path.join(tmp, f"node{node}"), node_local=True)
    return latest, warned


def _latest_placed(
    rank: int, world: int, tmp: str, nodes: list[int]
) -> tuple[str, float, float, bool]:
    latest, warned = _latest_on_node(nodes[rank], tmp)
    assert latest is not None
    state = {f"rank{rank}": torch.zeros(1000), "w": torch.zeros(10)}
    dcp.load(state, latest)
    named = any("step-5: different .metadata files on node" in m for m in warned)
    return os.path.basename(latest), state[f"rank{rank}"][0].item(), state["w"][0].item(), named


def test_a_step_saved_into_again_with_the_ranks_on_other_nodes_loads_the_new_save(
    tmp_path: Path,
) -> None:
    """Saved into again with the ranks swapped: every node first removes the earlier save's
    .metadata and data files, and a restart on the first placement loads the new save, not half
    of each."""
    tmp = str(tmp_path)
    run_ranks(_save_placed, 2, tmp, 3, [0, 1], 30.0, False)
    run_ranks(_save_placed, 2, tmp, 5, [0, 1], 50.0, False)
    run_ranks(_save_placed, 2, tmp, 5, [1, 0], 60.0, True)
    left = os.listdir(_node_dir(tmp, 0, 5))  # only rank 1's new files (and their checksums)
    assert left and all(name.startswith(("__1_", ".checksums-1.")) for name in left), left
    results = run_ranks(_latest_placed, 2, tmp, [0, 1])
    assert results == [("step-5", 60.0, 60.0, False), ("step-5", 61.0, 60.0, False)]


def test_nodes_holding_different_metadata_skip_the_step_with_a_warning(tmp_path: Path) -> None:
    """A node kept another save's .metadata (e.g. it was away while the step was saved again):
    which one is newer cannot be told, so the step is not loaded at all."""
    tmp = str(tmp_path)
    run_ranks(_save_placed, 2, tmp, 3, [0, 1], 30.0, False)
    run_ranks(_save_placed, 2, tmp, 5, [0, 1], 50.0, False)
    shutil.copy(
        os.path.join(_node_dir(tmp, 0, 3), ".metadata"),
        os.path.join(_node_dir(tmp, 1, 5), ".metadata"),
    )
    results = run_ranks(_latest_placed, 2, tmp, [0, 1])
    assert results == [("step-3", 30.0, 30.0, True), ("step-3", 31.0, 30.0, True)]


def test_a_node_away_while_its_step_was_saved_again_keeps_nothing_that_is_read(
    tmp_path: Path,
) -> None:
    """Node 1 is away while step 5 is saved again (rank 1 runs on node 2 instead). Back after the
    next restart, it still holds rank 1's files of the earlier save; they must not pass for the new
    save's (each save names its files anew): rank 1 fetches its new files from node 2."""
    tmp = str(tmp_path)
    run_ranks(_save_placed, 3, tmp, 5, [0, 1, 2], 50.0, False)
    run_ranks(_save_placed, 3, tmp, 5, [0, 2, 2], 60.0, True)
    kept = sorted(os.listdir(_node_dir(tmp, 1, 5)))
    assert kept and all(n.startswith(("__1_", ".checksums-1.")) for n in kept), kept  # earlier save
    results = run_ranks(_latest_placed, 3, tmp, [0, 1, 2])
    assert results == [
        ("step-5", 60.0, 60.0, False),
        ("step-5", 61.0, 60.0, False),
        ("step-5", 62.0, 60.0, False),
    ]
    assert set(kept) <= set(os.listdir(_node_dir(tmp, 1, 5)))  # left there, never read


def _latest_warned(rank: int, world: int, tmp: str) -> tuple[str | None, list[str]]:
    latest, warned = _latest_on_node(rank, tmp)
    return latest and os.path.basename(latest), warned


def test_a_marker_a_node_kept_skips_the_step_with_a_warning(tmp_path: Path) -> None:
    """Node 1 kept rank 1's marker of step 5 (a save there did not finish): step 3 is loaded and
    the decider says which step was skipped and why."""
    tmp = str(tmp_path)
    run_ranks(_save_placed, 2, tmp, 3, [0, 1], 30.0, False)
    run_ranks(_save_placed, 2, tmp, 5, [0, 1], 50.0, False)
    Path(_node_dir(tmp, 1, 5), ".unfinished-1").touch()
    (latest0, warned0), (latest1, warned1) = run_ranks(_latest_warned, 2, tmp)
    assert latest0 == latest1 == "step-3"
    # named as node 1 sees it: the marker is in its directory, not in the deciding rank's
    marked = f"{_node_dir(tmp, 1, 5)} has a .metadata but unfinished markers of rank(s) 1"
    assert any(m.startswith(marked) for m in warned0), warned0
    assert not warned1  # said once, by the deciding rank


def test_plan_fetches_the_checksum_manifest_with_each_data_file() -> None:
    nodes = ["a", "a", "b", "b"]
    required = {f"__{r}_0.t{r}.distcp": 100 for r in range(4)}
    manifests = {f".checksums-{r}.t{r}.json": 50 for r in range(4)}
    full = {**required, **manifests, ".metadata": 10}
    moves = plan_moves([full, full, {}, {}], required, 10, nodes)
    assert sorted((dst, name) for _, dst, name in moves) == [
        (2, ".checksums-2.t2.json"),
        (2, ".metadata"),
        (2, "__2_0.t2.distcp"),
        (3, ".checksums-3.t3.json"),
        (3, "__3_0.t3.distcp"),
    ]
    # A checkpoint without manifests (plain torch) needs none; an empty copy does not count.
    assert len(plan_moves([required | {".metadata": 10}] * 2 + [{}, {}], required, 10, nodes)) == 3
    empty = {**full, ".checksums-2.t2.json": 0}
    assert (0, 2, ".checksums-2.t2.json") in plan_moves([full, empty, {}, {}], required, 10, nodes)


def _hsdp(rank: int, world: int, tmp: str) -> dict:
    """HSDP's layout on a (2, 2) mesh, one node per replica: ``w`` is replicated across the nodes
    and sharded within each; ``u`` is sharded over every rank, so that every rank writes a file."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ["TIERPOINT_NODE_ID"] = f"node{rank // 2}"
    base = os.path.join(tmp, f"node{rank // 2}")
    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(64.0).reshape(16, 4)
    placements = {"w": [Replicate(), Shard(0)], "u": [Shard(0), Shard(1)]}
    dcp.save({k: distribute_tensor(full, mesh, p) for k, p in placements.items()}, base + "/step-1")
    # The same job resumes: same ranks, same nodes, same layout.
    latest = dcp.get_latest_complete_checkpoint(base, node_local=True)
    state = {k: distribute_tensor(torch.zeros(16, 4), mesh, p) for k, p in placements.items()}
    dcp.load(state, latest)
    return {k: torch.equal(v.full_tensor(), full) for k, v in state.items()}


def test_chunks_replicated_across_nodes_are_fetched_at_the_same_world_size(tmp_path: Path) -> None:
    # torch DCP writes each replicated chunk of w from ranks 0 and 1 only (node 0); before the fix
    # node 1 fetched only .metadata and load failed there with "missing DCP data file".
    assert run_ranks(_hsdp, WORLD, str(tmp_path)) == [{"w": True, "u": True}] * WORLD


def test_without_recorded_plans_a_tensor_with_fewer_chunks_than_writers_is_shared() -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from tierpoint.dcp.peer_fetch import _replicated_chunk_files

    def tensor(rows: list[int]) -> TensorStorageMetadata:
        chunks = [ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([8, 4])) for r in rows]
        return TensorStorageMetadata(TensorProperties(), torch.Size([8 * len(rows), 4]), chunks)

    storage = {
        MetadataIndex("w", torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, 10),
        MetadataIndex("w", torch.Size([8, 0])): _StorageInfo("__1_0.distcp", 0, 10),
    }
    for rank in range(4):
        index = MetadataIndex("u", torch.Size([8 * rank, 0]))
        storage[index] = _StorageInfo(f"__{rank}_1.distcp", 0, 10)
    metadata = Metadata({"w": tensor([0, 8]), "u": tensor([0, 8, 16, 24])}, None, storage)
    assert _replicated_chunk_files(metadata) == {"__0_0.distcp", "__1_0.distcp"}


def _other_layout(rank: int, world: int, tmp: str) -> dict:
    """Saved sharded over the 4 ranks, loaded whole (FSDP to DDP) by the same 4 ranks on the same
    nodes: a node needs the other node's files too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tierpoint.errors import CorruptCheckpointError

    os.environ["TIERPOINT_NODE_ID"] = f"node{rank // 2}"
    base = os.path.join(tmp, f"node{rank // 2}")
    full = torch.arange(64.0).reshape(16, 4)
    mesh = init_device_mesh("cpu", (world,))
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, base + "/step-1")
    state = {"w": torch.zeros(16, 4)}
    try:  # the files the saved layout needs are all on their nodes: nothing is fetched
        dcp.load(state, dcp.get_latest_complete_checkpoint(base, node_local=True))
        refused = ""
    except CorruptCheckpointError as e:
        refused = str(e)
    dcp.load(state, dcp.get_latest_complete_checkpoint(base, node_local=True, all_files=True))
    return {"refused": "all_files=True" in refused, "equal": torch.equal(state["w"], full)}


def test_a_load_in_another_layout_at_the_same_world_size_fetches_every_file(tmp_path: Path) -> None:
    """Without ``all_files`` the load names the missing file and says what fetches it (it read as
    damage alone); with it, every node gets every data file and the load is exact."""
    assert run_ranks(_other_layout, WORLD, str(tmp_path)) == [{"refused": True, "equal": True}] * 4
