"""Local parts left in the directories of ranks that now run on other nodes: a job whose nodes'
ranks changed since the save resumes from the newest step complete in the cluster, not from an
older (stale) one, and its next save does not remove the newer parts. 4 real gloo ranks; each
simulated node has its own local root."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from tierpoint import TieredCheckpointManager
from tierpoint.testing import run_ranks

from ..tiered.helpers import assert_same, fingerprint, make_state, train_step

WORLD = 4


def _run(
    rank: int, world: int, root: Path, nodes: list[int], steps: int, shared: bool = False
) -> tuple:
    """Restore (checked bit for bit against what was saved at that step), then train and save
    ``steps`` more steps locally on the layout ``nodes`` (the node of each rank), each node with
    its own local root (``shared``: one root for all)."""
    import os

    os.environ["TIERPOINT_NODE_ID"] = f"node{nodes[rank]}"
    saved_at = root / f"saved{rank}.pt"
    state = make_state(rank)
    kwargs = {"local_every": 2, "keep_local": 2}
    local = root / ("shared" if shared else f"node{nodes[rank]}")
    with TieredCheckpointManager(str(local), None, "job", **kwargs) as m:
        step = m.restore(state)
        saved = torch.load(saved_at) if step is not None else {}
        if step is not None:
            assert_same(fingerprint(state), saved[step])
        tier = m.last_restore.tier
        for s in range((step or 0) + 1, (step or 0) + steps + 1):
            train_step(state, world)
            m.maybe_save(s, state)
            saved[s] = fingerprint(state)
    torch.save(saved, saved_at)
    return step, tier


@pytest.mark.slow
def test_a_job_back_on_the_node_it_lost_resumes_from_the_newest_step(shm_dir):
    """Steps 2-6 saved on 2 nodes; node 1 lost, the job goes on with all 4 ranks on node 0 and
    saves 8-12 there (ranks 2 and 3's parts in node 0's directories 2 and 3); node 1 back with its
    old parts of 4 and 6. Step 12 is complete on node 0: restored, bit for bit (it restored the
    stale step 6 and its next save removed 10 and 12)."""
    assert run_ranks(_run, WORLD, shm_dir, [0, 0, 1, 1], 6) == [(None, None)] * WORLD
    assert run_ranks(_run, WORLD, shm_dir, [0, 0, 0, 0], 6) == [(6, "peers")] * WORLD
    assert run_ranks(_run, WORLD, shm_dir, [0, 0, 1, 1], 2) == [(12, "peers")] * WORLD
    assert run_ranks(_run, WORLD, shm_dir, [0, 0, 1, 1], 0) == [(14, "local")] * WORLD


def _rank_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "job").iterdir() if p.is_dir())


def test_nodes_back_with_each_others_ranks_resume_from_the_newest_step(shm_dir):
    """The two nodes come back with each other's ranks (numbered anew at a rendezvous): every
    part of step 6 is on some node, in the directory of a rank that runs on the other node now.
    It restores, bit for bit (it refused: no complete local checkpoint). Once steps 8 and 10 are
    kept, the directories the moved ranks left behind are gone (they held the RAM disk for good:
    parts of steps 2-6, spares)."""
    run_ranks(_run, WORLD, shm_dir, [0, 0, 1, 1], 6)
    assert run_ranks(_run, WORLD, shm_dir, [1, 1, 0, 0], 4) == [(6, "peers")] * WORLD
    assert _rank_dirs(shm_dir / "node0") == ["2", "3"]
    assert _rank_dirs(shm_dir / "node1") == ["0", "1"]
    assert run_ranks(_run, WORLD, shm_dir, [1, 1, 0, 0], 0) == [(10, "local")] * WORLD


def test_a_root_every_node_shares_keeps_the_files_of_every_rank(shm_dir):
    """One local root for both nodes, their ranks swapped at the restart: no directory is taken
    for one left behind (each node's leader sees the others' directories, written from their
    current nodes), so every rank keeps its kept parts and its spares."""
    run_ranks(_run, WORLD, shm_dir, [0, 0, 1, 1], 6, True)
    assert run_ranks(_run, WORLD, shm_dir, [1, 1, 0, 0], 2, True) == [(6, "local")] * WORLD
    for rank in range(WORLD):
        names = {p.name for p in (shm_dir / "shared" / "job" / str(rank)).iterdir()}
        assert {f"iter_000000{s}_{rank}_local.safetensors" for s in (6, 8)} <= names
        assert "spare_0.free" in names, sorted(names)
    assert run_ranks(_run, WORLD, shm_dir, [1, 1, 0, 0], 0, True) == [(8, "local")] * WORLD


def test_nodes_swapping_ranks_back_and_forth_resume_from_the_newest_step(shm_dir):
    """The nodes swap their ranks at each restart: each node's directories of the ranks it runs
    now hold every rank's own part of an older step (saved two runs ago), the newer one lies in
    the directories of the other ranks. It restores the newer step (every rank held its own part
    of step 6 and none a newer one: step 6 was taken, and the next save removed 8)."""
    run_ranks(_run, WORLD, shm_dir, [0, 0, 1, 1], 6)
    assert run_ranks(_run, WORLD, shm_dir, [1, 1, 0, 0], 2) == [(6, "peers")] * WORLD
    assert run_ranks(_run, WORLD, shm_dir, [0, 0, 1, 1], 0) == [(8, "peers")] * WORLD


def _restore_refused(rank: int, world: int, root: Path, nodes: list[int]) -> str:
    import os

    from tierpoint import CheckpointingError

    os.environ["TIERPOINT_NODE_ID"] = f"node{nodes[rank]}"
    with TieredCheckpointManager(str(root / f"node{nodes[rank]}"), None, "job", local_every=2) as m:
        with pytest.raises(CheckpointingError) as raised:
            m.restore(make_state(rank))
    return str(raised.value)


def test_parts_of_moved_ranks_that_cannot_be_copied_are_named_not_taken_for_none(tmp_path):
    """The nodes come back with each other's ranks and their RAM disks full: the parts of step 6
    cannot be copied to the ranks that run there now. The restore refuses on every rank, saying
    that the ranks of a node changed (a restore that answered None would start over and save over
    them)."""
    from ..mounts import small_tmpfs

    with small_tmpfs(tmp_path / "node0", "2m"), small_tmpfs(tmp_path / "node1", "2m"):
        run_ranks(_run, WORLD, tmp_path, [0, 0, 1, 1], 6)
        for node in ("node0", "node1"):
            with open(tmp_path / node / "filler", "wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        before = sorted(p.name for p in tmp_path.rglob("iter_*"))
        messages = run_ranks(_restore_refused, WORLD, tmp_path, [1, 1, 0, 0])
        assert all("the ranks of a node changed since the save" in m for m in messages), messages
        assert sorted(p.name for p in tmp_path.rglob("iter_*")) == before


def _save_local(rank: int, world: int, root: Path, nodes: list[int], iterations: list[int]) -> int:
    """The NVRx-named manager: find_latest, then save ``iterations`` on one root for all nodes."""
    import os

    from tierpoint import BasicTensorAwareStateDict
    from tierpoint.local import LocalCheckpointManager

    os.environ["TIERPOINT_NODE_ID"] = f"node{nodes[rank]}"
    manager = LocalCheckpointManager(str(root), session_id="job")
    latest = manager.find_latest()
    for it in iterations:
        manager.save(BasicTensorAwareStateDict({"x": torch.full((256,), float(it + rank))}), it)
    return latest


def test_a_shrunk_job_on_a_root_every_node_shares_removes_the_directories_of_ranks_gone(shm_dir):
    """4 ranks on 2 nodes, then 2 ranks (one a node) on the same shared root: the directories of
    ranks 2 and 3 (no rank saves there any more) go, whatever order the root lists its entries in
    (each node's leader saw a live directory of the other node first and stopped looking: they
    stayed for good)."""
    run_ranks(_save_local, WORLD, shm_dir, [0, 0, 1, 1], [1, 2, 3])
    session = shm_dir / "job"
    for name in ("0", "1"):  # listed first on tmpfs (as a hashed order may list them anywhere)
        (session / name).rename(session / f"{name}.moved")
        (session / f"{name}.moved").rename(session / name)
    assert run_ranks(_save_local, 2, shm_dir, [0, 1], [10, 11, 12]) == [-1, -1]
    assert _rank_dirs(shm_dir) == ["0", "1"]
    assert sorted(p.name for p in session.glob("*.node")) == ["0.node", "1.node"]


def _save_only(rank: int, world: int, root: Path, nodes: list[int], iterations: list[int]) -> None:
    """Saves without find_latest or replication, each node its own root."""
    import os

    from tierpoint import BasicTensorAwareStateDict
    from tierpoint.local import LocalCheckpointManager

    os.environ["TIERPOINT_NODE_ID"] = f"node{nodes[rank]}"
    manager = LocalCheckpointManager(str(root / f"node{nodes[rank]}"), session_id="job")
    for it in iterations:
        manager.save(BasicTensorAwareStateDict({"x": torch.full((256,), float(it + rank))}), it)


def test_a_job_that_only_saves_removes_the_directories_its_moved_ranks_left(shm_dir):
    """A job that starts over (no find_latest, no replicas) on nodes that swapped their ranks: the
    directories of the ranks that run on the other node now go (the node layout was never
    gathered, so they stayed for good)."""
    run_ranks(_save_only, WORLD, shm_dir, [0, 0, 1, 1], [1, 2, 3])
    run_ranks(_save_only, WORLD, shm_dir, [1, 1, 0, 0], [10, 11, 12])
    assert _rank_dirs(shm_dir / "node0") == ["2", "3"]
    assert _rank_dirs(shm_dir / "node1") == ["0", "1"]
