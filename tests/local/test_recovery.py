"""Loading with lost or damaged parts on 4 real gloo ranks, two simulated nodes (ranks 0-1 and 2-3):
a wiped node is restored from its peers, a corrupt part is replaced, a part with no good copy is never
loaded, and losing a whole clique falls back to an older iteration."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from tests.collectives import CountCollectives
from tierpoint.errors import CheckpointingError
from tierpoint.local import BasicTensorAwareStateDict
from tierpoint.local.naming import part_name
from tierpoint.testing import run_ranks

from ..mounts import small_tmpfs
from .helpers import (
    WarningRecords,
    as_node,
    assert_bitwise_equal,
    flip_tensor_byte,
    load_latest,
    make_state,
    part_files,
    replicated_manager,
    save_replicated,
)

WORLD = 4


def test_wiped_node_is_restored_from_peers(tmp_path: Path) -> None:
    lazy = True  # the lazy strategy sets itself up inside the first save / find_latest
    listings = run_ranks(save_replicated, WORLD, str(tmp_path), [3, 7], lazy)
    peer = {0: 2, 1: 3, 2: 0, 3: 1}
    for rank in range(WORLD):
        expected = {part_name(it, r) for it in (3, 7) for r in (rank, peer[rank])}
        assert set(listings[rank]) == expected
    # Node 1 (ranks 2 and 3) is replaced: its root is empty.
    for rank in (2, 3):
        shutil.rmtree(tmp_path / "job" / str(rank))
    results = run_ranks(load_latest, WORLD, str(tmp_path), lazy)
    assert [it for it, _ in results] == [7] * WORLD
    # After the load, node 1 holds its own parts and its replicas of node 0's parts again.
    for rank in (2, 3):
        assert set(part_files(tmp_path, rank)) >= {part_name(7, rank), part_name(7, peer[rank])}
    # ... so losing node 0 now is survivable too.
    for rank in (0, 1):
        shutil.rmtree(tmp_path / "job" / str(rank))
    assert [it for it, _ in run_ranks(load_latest, WORLD, str(tmp_path))] == [7] * WORLD


def _load_expecting_an_error(rank: int, world: int, root: str) -> str:
    as_node(rank)
    manager = replicated_manager(root)
    assert manager.find_latest() == 7
    with pytest.raises(CheckpointingError, match="could be loaded on every rank") as raised:
        manager.load()
    return str(raised.value)


def test_a_replaced_node_whose_directory_cannot_be_made_fails_alike_on_every_rank(
    tmp_path: Path,
) -> None:
    """Node 1 replaced, and rank 2's directory cannot be created (a file in its place): every rank
    raises the same CheckpointingError naming rank 2's problem (before: rank 2 raised a bare
    NotADirectoryError and the others "a peer rank is probably gone")."""
    run_ranks(save_replicated, WORLD, str(tmp_path), [3, 7], False)
    for rank in (2, 3):
        shutil.rmtree(tmp_path / "job" / str(rank))
    (tmp_path / "job" / "2").write_text("not a directory")
    messages = run_ranks(_load_expecting_an_error, WORLD, str(tmp_path), timeout=90)
    assert len(set(messages)) == 1
    assert "rank 2:" in messages[0] and "Not a directory" in messages[0]


def test_a_replaced_rank_with_a_full_disk_says_so_on_every_rank(tmp_path: Path) -> None:
    """Rank 2's parts are gone and its disk is full: the copies of its part cannot be written
    there. Every rank's error says so (it said only "...: missing", as if no copy existed)."""
    run_ranks(save_replicated, WORLD, str(tmp_path), [3, 7], False)
    shutil.rmtree(tmp_path / "job" / "2")
    with small_tmpfs(tmp_path / "job" / "2", "1m") as full:
        free = os.statvfs(full)
        (full / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize))
        messages = run_ranks(_load_expecting_an_error, WORLD, str(tmp_path), timeout=90)
        assert sorted(os.listdir(full)) == ["filler"]  # no half-written copy left
    assert len(set(messages)) == 1
    assert "rank 2:" in messages[0] and "No space left on device" in messages[0], messages[0]


def _load_then_rank_0_dies(rank: int, world: int, root: str) -> tuple[float, list[str]]:
    import time

    from tierpoint.peers import transfer

    as_node(rank)
    records = WarningRecords()
    manager = replicated_manager(root)
    if rank == 0:
        real = transfer.move_files

        def dies_in_the_background(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                os._exit(3)  # gone while the replica of its part is on its way to rank 2
            return real(*args, **kwargs)

        transfer.move_files = dies_in_the_background
    manager.find_latest()
    ta, _ = manager.load()
    assert_bitwise_equal(ta.state_dict, make_state(rank, 3))
    start = time.monotonic()
    manager.wait_for_restore()
    return time.monotonic() - start, records.messages


def test_a_peer_lost_while_replicas_come_back_is_a_warning_not_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_ranks(save_replicated, WORLD, str(tmp_path), [3], False)
    for rank in (2, 3):
        shutil.rmtree(tmp_path / "job" / str(rank))
    monkeypatch.setenv("TIERPOINT_TIMEOUT", "20")
    results = run_ranks(_load_then_rank_0_dies, WORLD, str(tmp_path), allow_crash={0}, timeout=150)
    seconds, messages = results[2]
    assert seconds < 60
    assert any("could not restore the replica of rank 0's part" in m for m in messages), messages
    node1 = tmp_path / "job"
    assert not (node1 / "2" / part_name(3, 0)).exists()  # no partial replica, no dirty file
    assert not [p for p in (node1 / "2").iterdir() if p.name.endswith(".dirty")]
    assert (node1 / "2" / part_name(3, 2)).exists()  # its own part came back before load returned
    assert (node1 / "3" / part_name(3, 1)).exists()  # rank 1's replica reached rank 3


def test_corrupt_part_is_replaced_with_a_warning(tmp_path: Path) -> None:
    run_ranks(save_replicated, WORLD, str(tmp_path), [4], False)
    victim = tmp_path / "job" / "1" / part_name(4, 1)
    data = flip_tensor_byte(victim)
    results = run_ranks(load_latest, WORLD, str(tmp_path))
    assert [it for it, _ in results] == [4] * WORLD
    warning = [m for m in results[1][1] if "replaced" in m]
    assert warning and warning[0].count(str(victim)) == 1 and "rank 3" in warning[0]
    assert "checksum" in warning[0]  # why it was replaced
    assert victim.read_bytes() != bytes(data)  # the good copy now sits on disk


def _load_then_save_next(rank: int, world: int, root: str) -> tuple[int, int, list[str], int]:
    as_node(rank)
    records = WarningRecords()
    manager = replicated_manager(root, keep_last=2)
    ta, ckpt = manager.load()
    assert_bitwise_equal(ta.state_dict, make_state(rank, ckpt.iteration))
    for iteration in (ckpt.iteration + 1, ckpt.iteration + 2):
        with CountCollectives() as counted:  # the second save agrees by counting again
            manager.save(BasicTensorAwareStateDict(make_state(rank, iteration)), iteration)
    return ckpt.iteration, manager.find_latest(), records.messages, counted["all_gather"]


def test_a_part_corrupt_on_every_holder_is_never_loaded_and_saving_goes_on(tmp_path: Path) -> None:
    run_ranks(save_replicated, WORLD, str(tmp_path), [5, 9], False)
    for holder in (1, 3):  # rank 1's part of iteration 9 and its only replica
        flip_tensor_byte(tmp_path / "job" / str(holder) / part_name(9, 1))
    results = run_ranks(_load_then_save_next, WORLD, str(tmp_path))
    # Iteration 9 cannot be had bitwise on rank 1: every rank resumes from 5 and saves 6 over 9.
    assert [(loaded, latest) for loaded, latest, *_ in results] == [(5, 7)] * WORLD
    assert [gathers for *_, gathers in results] == [0] * WORLD  # iteration 9 is gone: none
    assert not any("replaced by the copy" in m for m in results[1][2])
    assert any("no rank holds a good copy of the part of rank 1" in m for m in results[0][2])
    assert not any(
        part_name(9, 1) in name for r in range(WORLD) for name in part_files(tmp_path, r)
    )
    assert [it for it, _ in run_ranks(load_latest, WORLD, str(tmp_path))] == [7] * WORLD


def test_losing_a_whole_clique_falls_back_or_says_so(tmp_path: Path) -> None:
    run_ranks(save_replicated, WORLD, str(tmp_path), [5, 9], False)
    # Clique {0, 2} loses every copy of iteration 9: 5 is the newest complete one.
    for holder in (0, 2):
        for origin in (0, 2):
            (tmp_path / "job" / str(holder) / part_name(9, origin)).unlink()
    results = run_ranks(load_latest, WORLD, str(tmp_path))
    assert [it for it, _ in results] == [5] * WORLD
    assert any("iteration 9 is incomplete" in m and "ranks 0, 2" in m for m in results[0][1])
    # Both nodes of the clique wiped entirely: nothing complete remains.
    for holder in (0, 2):
        shutil.rmtree(tmp_path / "job" / str(holder))
    results = run_ranks(load_latest, WORLD, str(tmp_path))
    assert [it for it, _ in results] == [-1] * WORLD
    assert any("no older complete iteration" in m for m in results[0][1])


def _stale_part_of_an_earlier_save(rank: int, world: int, root: str) -> tuple[int, int, list[str]]:
    """Run A saves 5 and 6; run B resumes from 5 (A's 6 lost) and saves its own 6; then rank 1's
    node comes back with A's part of 6. (loaded iteration, its saved step, warnings)."""
    import torch.distributed as dist

    from tierpoint.local import LocalCheckpointManager

    as_node(rank, 1)
    root_path = Path(root)
    manager = LocalCheckpointManager(root, session_id="job", keep_last=2)
    for it in (5, 6):
        manager.save(BasicTensorAwareStateDict(make_state(rank, it)), it)
    part = root_path / "job" / str(rank) / part_name(6, rank)
    stale = part.read_bytes()
    dist.barrier()
    part.unlink()  # run A's 6 is lost on every node
    dist.barrier()
    manager = LocalCheckpointManager(root, session_id="job", keep_last=2)
    assert manager.find_latest() == 5
    manager.load()
    manager.save(BasicTensorAwareStateDict(make_state(rank, 60)), 6)  # run B's 6
    dist.barrier()
    if rank == 1:
        part.write_bytes(stale)  # the node that kept run A's part of 6 is back
    dist.barrier()
    records = WarningRecords()
    manager = LocalCheckpointManager(root, session_id="job", keep_last=2)
    ta, _ = manager.load()
    assert manager.last_load is not None
    return manager.last_load.iteration, ta.state_dict["optimizer"]["step"], records.messages


def test_parts_of_two_saves_of_one_iteration_are_never_loaded_together(tmp_path: Path) -> None:
    """Every part of iteration 6 is intact, but rank 0's comes from run B's save and rank 1's from
    run A's: the load fell back to 5 (it loaded a mix of the two, silently)."""
    results = run_ranks(_stale_part_of_an_earlier_save, 2, str(tmp_path))
    for iteration, step, warnings in results:
        assert (iteration, step) == (5, 5)
        assert any("different saves" in w for w in warnings)
