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
            assert inode not in names or names[inode] == naming.part_name(1, 0)  # never a spare
    assert bytes(held.source.view()) == original  # the reader's bytes are iteration 1's
    assert_bitwise_equal(held.tree, make_state(0, 1))  # and so are the mapped tensors
    held.release()
    held.release()  # idempotent
    assert held.tree is None and not held.held
    ta, _ = LocalCheckpointManager(shm_dir, session_id="job").load()
    assert_bitwise_equal(ta.state_dict, make_state(0, 5))


def test_the_store_never_recycles_a_held_file(tmp_path):
    """The hold alone (no live mapping of the file in this process) keeps a file from being made a
    spare by retirement and from being handed out as one."""
    store = PartStore(tmp_path, "job")
    store.ensure_dir()
    one, two = store.part_path(1), store.part_path(2)
    one.write_bytes(b"one")
    two.write_bytes(b"two")
    key = store.hold(os.stat(one))
    store.retire({3}, max_spares=2)
    assert not one.exists()  # removed, not made a spare: its reader keeps the pages
    (spare,) = [p for p in store.directory.iterdir() if naming.is_spare_name(p.name)]
    assert spare.read_bytes() == b"two"
    store.release(key)

    spare_key = store.hold(os.stat(spare))
    assert store.take_spare(leftovers=False) is None  # held: not handed out
    store.release(spare_key)
    assert store.take_spare(leftovers=False) == spare


def test_holding_a_part_that_is_not_there_is_a_clear_error(tmp_path):
    manager = LocalCheckpointManager(tmp_path, session_id="job")
    manager.save(BasicTensorAwareStateDict({"w": torch.ones(3)}), 1)
    with pytest.raises(CheckpointingError, match="cannot open this rank's part"):
        manager.hold_own_part(2)
    held = manager.hold_own_part(1)
    assert torch.equal(held.tree["w"], torch.ones(3))
    held.release()
