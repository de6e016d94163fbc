"""The local tier's files on one rank: spares made ahead of the first saves; entries that cannot
be read are skipped, not fatal."""

from __future__ import annotations

import os

import pytest
import torch

from tierpoint import fileformat
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.cli import main
from tierpoint.errors import CheckpointingError
from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager, naming
from tierpoint.local.store import PartStore
from tierpoint.testing import run_ranks


def test_spares_made_ahead_have_their_space_and_stay_mapped(shm_dir):
    store = PartStore(shm_dir, "job")
    assert store.make_spares(3 << 20, 2) == 2
    spares = sorted(
        (e for e in os.scandir(store.directory) if e.name.startswith("spare_")),
        key=lambda e: e.name,
    )
    assert [e.name for e in spares] == ["spare_0.free", "spare_1.free"]
    assert all(e.stat().st_size == 3 << 20 <= e.stat().st_blocks * 512 for e in spares)
    assert len(store.mappings) == 2
    assert store.make_spares(3 << 20, 2) == 0  # there already
    store.mappings.close()


def test_a_dangling_link_or_link_loop_named_as_a_part_is_skipped_and_cleaned_up(tmp_path, caplog):
    manager = LocalCheckpointManager(tmp_path, session_id="s")
    manager.save(BasicTensorAwareStateDict({"w": torch.ones(2)}), 1)
    directory = tmp_path / "s" / "0"
    (directory / "iter_0000005_0_local.safetensors").symlink_to(tmp_path / "nowhere")
    loop = directory / "iter_0000006_0_local.safetensors"
    loop.symlink_to(loop)
    again = LocalCheckpointManager(tmp_path, session_id="s")
    assert again.find_latest() == 1
    assert "iter_0000005_0_local.safetensors" in caplog.text and "symbolic links" in caplog.text
    again.save(BasicTensorAwareStateDict({"w": torch.full((2,), 2.0)}), 7)
    state, _ = again.load()
    assert again.find_latest() == 7 and torch.equal(state.state_dict["w"], torch.full((2,), 2.0))
    assert not any(p.is_symlink() for p in directory.iterdir())  # retired with iteration 1


def _assert_written_here(outside, tier_root, iteration: int) -> None:
    """The file a link pointed to is untouched; the part of ``iteration`` is a file of its own,
    and it loads."""
    assert outside.read_bytes() == b"precious" * 1000
    part = tier_root / "s" / "0" / f"iter_{iteration:07d}_0_local.safetensors"
    assert part.is_file() and not part.is_symlink()
    loaded, _ = LocalCheckpointManager(tier_root, session_id="s").load()
    assert torch.equal(loaded.state_dict["w"], torch.arange(100.0))


def test_a_link_or_directory_named_as_a_spare_is_never_written_through(tier_root):
    # A spare_<n>.free link was taken for a spare: the next save wrote its part through it into the
    # file it pointed to (outside the tier) and committed the link; warm_up mapped that file
    # writable. A directory of that name failed every save (IsADirectoryError).
    outside = tier_root.parent / f"{tier_root.name}-outside.txt"
    outside.write_bytes(b"precious" * 1000)
    try:
        manager = LocalCheckpointManager(tier_root, session_id="s")
        state = BasicTensorAwareStateDict({"w": torch.arange(100.0)})
        manager.save(state, 1)
        directory = manager.local_ckpt_dir
        (directory / "spare_0.free").symlink_to(outside)
        (directory / "spare_1.free").mkdir()
        (directory / "iter_0000009_0_local.safetensors.dirty").symlink_to(outside)
        manager.warm_up(state, wait=True)
        for iteration in (2, 3):
            manager.save(state, iteration)
        _assert_written_here(outside, tier_root, 3)
    finally:
        outside.unlink()


def test_names_and_metadata_take_ascii_digits_and_integers_only(tmp_path):
    manager = LocalCheckpointManager(tmp_path, session_id="s")
    manager.save(BasicTensorAwareStateDict({"w": torch.ones(2)}), 1)
    session = tmp_path / "s"
    (session / "\u00b2").mkdir()  # a digit int() refuses: listing other ranks' directories failed
    (session / "\u0661").mkdir()  # an Arabic-Indic 1: int() reads it as rank 1's directory
    part = session / "0" / "iter_0000001_0_local.safetensors"
    # a crafted part of iteration 1 whose metadata says iteration True (== 1 in Python)
    fileformat.write(
        part, {"w": torch.zeros(2)}, extra={"iteration": True, "rank": 0, "world_size": 1}
    )
    again = LocalCheckpointManager(tmp_path, session_id="s")
    assert again.find_latest() == -1  # the part is not taken for iteration 1's
    with pytest.raises(CheckpointingError, match="no complete local checkpoint"):
        again.load()
    assert again.unusable_parts() == []


def test_a_default_root_that_is_not_this_users_own_directory_is_refused(monkeypatch, tmp_path):
    uid = os.getuid()
    # A user whose root someone else made; a uid of this process's own, so that the root, which
    # is shared by the whole machine, is no other test run's (several may run at once).
    fake = uid + 100_000 + os.getpid()
    monkeypatch.setattr(os, "getuid", lambda: fake)
    root = naming.default_root()
    assert not os.path.lexists(root)
    try:
        root.symlink_to(tmp_path)  # a link to a directory of someone else's choosing
        with pytest.raises(CheckpointingError, match="is a symbolic link, not this user's"):
            LocalCheckpointManager(session_id="s")
        root.unlink()
        root.mkdir()  # made by another user (the real uid)
        with pytest.raises(CheckpointingError, match=f"owned by uid {uid}"):
            LocalCheckpointManager(session_id="s")
        assert main(["ls"]) == 1
    finally:
        if root.is_symlink():
            root.unlink()
        elif root.exists():
            root.rmdir()
    assert list(tmp_path.iterdir()) == []  # nothing was written through the link


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_link_under_the_dirty_name_of_the_iteration_saved_is_never_written_through(
    tier_root, is_async
):
    # Only a link taken for a spare was refused: a leftover link under the dirty name of the very
    # iteration being saved was opened (O_TRUNC) and written through, the outside file truncated
    # and overwritten, and the link committed as the part.
    outside = tier_root.parent / f"{tier_root.name}-outside.txt"
    outside.write_bytes(b"precious" * 1000)
    try:
        manager = LocalCheckpointManager(tier_root, session_id="s")
        state = BasicTensorAwareStateDict({"w": torch.arange(100.0)})
        directory = manager.local_ckpt_dir
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "iter_0000001_0_local.safetensors.dirty").symlink_to(outside)
        if is_async:
            with AsyncCallsQueue() as queue:
                queue.schedule_async_request(manager.save(state, 1, is_async=True))
                queue.maybe_finalize_async_calls(blocking=True)
        else:
            manager.save(state, 1)
        _assert_written_here(outside, tier_root, 1)
    finally:
        outside.unlink()


def _save_world_two(rank: int, world: int, root: str) -> None:
    manager = LocalCheckpointManager(root, session_id="job")
    manager.save(BasicTensorAwareStateDict({"w": torch.full((3,), float(rank))}), 200)


def _fail_first_save_alone(rank: int, world: int, root: str) -> str:
    from tierpoint.local import saving

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    saving.PartSaver._write_part = disk_full
    manager = LocalCheckpointManager(root, session_id="job")
    assert manager.find_latest() == -1  # iteration 200 has another world size: not offered
    with pytest.raises(CheckpointingError, match="No space left on device") as raised:
        manager.save(BasicTensorAwareStateDict({"w": torch.ones(3)}), 100)
    return str(raised.value)


def _latest(rank: int, world: int, root: str) -> int:
    return LocalCheckpointManager(root, session_id="job").find_latest()


def test_a_failed_save_at_another_world_size_leaves_the_old_worlds_newer_checkpoint(tmp_path):
    """A job restarted with 1 rank instead of 2 starts over (the local tier does not reshard); its
    first save fails. The 2-rank checkpoint of a newer iteration must still be whole: only a
    committed save of the new world size retires it (a job back at 2 ranks loads it)."""
    run_ranks(_save_world_two, 2, str(tmp_path))
    run_ranks(_fail_first_save_alone, 1, str(tmp_path))
    assert run_ranks(_latest, 2, str(tmp_path)) == [200, 200]
    run_ranks(_save_alone, 1, str(tmp_path))  # committed: the other world's parts go with it
    parts = [name for name in os.listdir(tmp_path / "job" / "0") if name.startswith("iter_")]
    assert parts == [naming.part_name(100, 0)]


def _save_alone(rank: int, world: int, root: str) -> None:
    manager = LocalCheckpointManager(root, session_id="job")
    manager.save(BasicTensorAwareStateDict({"w": torch.ones(3)}), 100)


def _late_commit_of_an_earlier_attempt(rank: int, world: int, root: str) -> list[int]:
    """An earlier attempt's async save of iteration 3 is committed only after the restarted job
    (a second manager on the same root and session) saved iterations 4 and 5."""
    earlier = LocalCheckpointManager(root, session_id="job", keep_last=2)
    for it in (1, 2):
        earlier.save(BasicTensorAwareStateDict({"w": torch.full((8,), float(it))}), it)
    queue = AsyncCallsQueue()
    state = BasicTensorAwareStateDict({"w": torch.full((8,), 3.0)})
    queue.schedule_async_request(earlier.save(state, 3, is_async=True))
    restarted = LocalCheckpointManager(root, session_id="job", keep_last=2)
    assert restarted.find_latest() == 2
    for it in (4, 5):
        restarted.save(BasicTensorAwareStateDict({"w": torch.full((8,), 100.0 + it)}), it)
    queue.close()  # the earlier attempt's commit of iteration 3, and its retirement
    found = LocalCheckpointManager(root, session_id="job", keep_last=2)
    ta, ckpt_id = found.load()
    assert ckpt_id.iteration == 5 and float(ta.state_dict["w"][0]) == 105.0
    names = os.listdir(os.path.join(root, "job", str(rank)))
    return sorted({int(name.split("_")[1]) for name in names if name.startswith("iter_")})


def test_a_late_commit_of_an_earlier_attempt_never_retires_newer_parts(tmp_path):
    """Retiring keeps parts newer than the iteration committed: this process removed such parts
    before it saved, so another process (a stopped rank of an earlier attempt that woke up after
    the restart) wrote them. Retiring them removed the restarted job's newest checkpoints."""
    listings = run_ranks(_late_commit_of_an_earlier_attempt, 2, str(tmp_path))
    assert all({4, 5} <= set(iterations) for iterations in listings)
