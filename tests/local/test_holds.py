"""A committed part held for a reader (``LocalCheckpointManager.hold_own_part``): while held, its file
is never made a spare nor handed out for reuse, so later saves (async ones on a RAM tier, which
snapshot straight into recycled spares) never rewrite its bytes, even when retirement removes its
name; the reader sees through its own descriptor the bytes of its iteration. Released, the file is
a file like any other."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.errors import CheckpointingError
from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager, naming
from tierpoint.local.store import PartStore

from .helpers import assert_bitwise_equal, make_state


def _inodes(directory: Path) -> dict[int, str]:
    return {os.stat(p).st_ino: p.name for p in directory.iterdir()}


def test_a_held_part_keeps_its_bytes_while_later_saves_recycle_spares(shm_dir):
    manager = LocalCheckpointManager(shm_dir, session_id="job", keep_last=1)
    manager.save(BasicTensorAwareStateDict(make_state(0, 1)), 1)
    held = manager.hold_own_part(1)
    original = bytes(held.source.view())
    inode = os.fstat(held.source.fd).st_ino
    with AsyncCallsQueue() as queue:
        for it in (2, 3, 4, 5):  # keep_last=1: iteration 1 is retired at the first commit
            request = manager.save(BasicTensorAwareStateDict(make_state(0, it)), it, is_async=True)
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            names = _inodes(manager.local_ckpt_dir)
            # renamed to a spare at most, never written as a later iteration's part
            assert (
                inode not in names
                or names[inode] == naming.part_name(1, 0)
                or (naming.is_spare_name(names[inode]))
            )
    assert bytes(held.source.view()) == original  # the reader's bytes are iteration 1's
    assert_bitwise_equal(held.tree, make_state(0, 1))  # and so are the mapped tensors
    held.release()
    held.release()  # idempotent
    assert held.tree is None and not held.held
    ta, _ = LocalCheckpointManager(shm_dir, session_id="job").load()
    assert_bitwise_equal(ta.state_dict, make_state(0, 5))


def test_the_store_never_hands_out_a_held_file(tmp_path):
    """The hold alone (no live mapping of the file in this process) keeps a file from being handed
    out as a spare. Retirement makes it a spare beside those it keeps, reused once released, and
    keeps one more spare from then on (the next held part then finds one for the save after it)."""
    store = PartStore(tmp_path, "job")
    store.ensure_dir()
    one, two = store.part_path(1), store.part_path(2)
    one.write_bytes(b"one")
    two.write_bytes(b"two")
    held_inode = os.stat(one).st_ino
    key = store.hold(os.stat(one))
    store.retire({3}, max_spares=1)
    spares = {p.stat().st_ino: p for p in store.directory.iterdir() if naming.is_spare_name(p.name)}
    assert len(spares) == 2 and held_inode in spares  # "two" is the one spare counted
    taken = store.take_spare(leftovers=False)
    assert taken is not None and taken.read_bytes() == b"two"  # the held one is not handed out
    taken.unlink()  # (a save took it)
    assert store.take_spare(leftovers=False) is None
    store.release(key)
    assert store.take_spare(leftovers=False) == spares[held_inode]
    three = store.part_path(3)
    three.write_bytes(b"three")
    store.retire({4}, max_spares=1)  # one spare already: kept as the one more
    assert sorted(p.read_bytes() for p in store.directory.iterdir()) == [b"one", b"three"]


def test_holding_a_part_that_is_not_there_is_a_clear_error(tmp_path):
    manager = LocalCheckpointManager(tmp_path, session_id="job")
    manager.save(BasicTensorAwareStateDict({"w": torch.ones(3)}), 1)
    with pytest.raises(CheckpointingError, match="cannot open this rank's part"):
        manager.hold_own_part(2)
    held = manager.hold_own_part(1)
    assert torch.equal(held.tree["w"], torch.ones(3))
    held.release()


def test_without_recycling_no_spare_outlives_a_held_part(shm_dir):
    """recycle=False: a part held while later saves retire it is kept (as a spare) only while
    held; once released, the next commits leave nothing but the kept part (the one extra spare
    kept for holds was made even without recycling, and never taken)."""
    manager = LocalCheckpointManager(shm_dir, session_id="job", keep_last=1, recycle=False)
    manager.save(BasicTensorAwareStateDict(make_state(0, 1)), 1)
    held = manager.hold_own_part(1)
    for it in (2, 3):
        manager.save(BasicTensorAwareStateDict(make_state(0, it)), it)
    assert bytes(held.source.view())  # still readable
    held.release()
    for it in (4, 5, 6):
        manager.save(BasicTensorAwareStateDict(make_state(0, it)), it)
        assert sorted(os.listdir(manager.local_ckpt_dir)) == [naming.part_name(it, 0)]
