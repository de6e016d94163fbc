"""Warming the local tier up: the staging memory and the spare files of the first saves are prepared
ahead of them, in the background, and the first saves use them instead of allocating their own."""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import pytest
import torch

from tierpoint import CheckpointingError
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.fileformat import plan_part
from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager


def _state(seed: int, rows: int = 512) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 256, generator=g), "b": torch.randn(256, generator=g), "n": seed}


def _spares(manager: LocalCheckpointManager) -> dict[str, int]:
    return {
        e.name: e.stat().st_blocks * 512
        for e in os.scandir(manager.local_ckpt_dir)
        if e.name.startswith("spare_")
    }


def _save(manager: LocalCheckpointManager, queue: AsyncCallsQueue, it: int) -> None:
    queue.schedule_async_request(
        manager.save(BasicTensorAwareStateDict(_state(it)), it, is_async=True)
    )
    queue.maybe_finalize_async_calls(blocking=True)


def test_on_a_ram_tier_the_first_saves_fill_the_spares_made_ahead(shm_dir):
    manager = LocalCheckpointManager(shm_dir, session_id="job", keep_last=2)
    state = BasicTensorAwareStateDict(_state(0))
    manager.warm_up(state, wait=True)
    size = plan_part(state.to_flat(), {}).file_size()
    spares = _spares(manager)
    # keep_last complete parts and one in flight, their pages allocated already
    assert sorted(spares) == ["spare_0.free", "spare_1.free", "spare_2.free"]
    assert all(allocated >= size for allocated in spares.values())
    warm = {os.stat(manager.local_ckpt_dir / name).st_ino for name in spares}
    with AsyncCallsQueue() as queue:
        for it in (1, 2, 3, 4):
            _save(manager, queue, it)
    parts = {
        e.name.split("_")[1]: e.inode()
        for e in os.scandir(manager.local_ckpt_dir)
        if e.name.startswith("iter")
    }
    assert sorted(parts) == ["0000003", "0000004"]  # keep_last=2
    # iterations 1-3 filled the spares made ahead, 4 the pages of 1 (no file was created)
    assert parts["0000003"] in warm and parts["0000004"] in warm
    assert len(_spares(manager)) <= 1  # the steady state: nothing grew
    ta, ckpt = LocalCheckpointManager(shm_dir, session_id="job").load()
    assert ckpt.iteration == 4 and torch.equal(ta.state_dict["w"], _state(4)["w"])


def test_on_a_disk_tier_the_first_save_stages_into_the_buffer_made_ahead(tmp_path):
    manager = LocalCheckpointManager(tmp_path, session_id="job")
    manager.warm_up(BasicTensorAwareStateDict(_state(0)), wait=True)
    warmed = manager._stager.buffer
    assert warmed is not None and warmed.nbytes >= 512 * 256 * 4
    assert _spares(manager) == {}  # the worker writes new files on a disk: nothing to prepare
    with AsyncCallsQueue() as queue:
        for it in (1, 2):
            _save(manager, queue, it)
            assert manager._stager.buffer is warmed
    ta, ckpt = LocalCheckpointManager(tmp_path, session_id="job").load()
    assert ckpt.iteration == 2 and torch.equal(ta.state_dict["w"], _state(2)["w"])


def test_a_save_right_after_warm_up_waits_for_it_and_a_new_layout_still_saves(shm_dir):
    manager = LocalCheckpointManager(shm_dir, session_id="job")
    manager.warm_up(BasicTensorAwareStateDict(_state(0, rows=64)))  # not waited for
    manager.save(BasicTensorAwareStateDict(_state(1, rows=1024)), 1)  # another layout, sync
    ta, ckpt = LocalCheckpointManager(shm_dir, session_id="job").load()
    assert ckpt.iteration == 1 and torch.equal(ta.state_dict["w"], _state(1, rows=1024)["w"])


def test_a_tier_without_room_for_spares_warms_up_what_fits_and_saves(tmp_path, caplog):
    from tests.mounts import small_tmpfs

    with small_tmpfs(tmp_path / "small", "3m") as root:
        manager = LocalCheckpointManager(root, session_id="job", keep_last=2)
        state = _state(0, rows=1024)  # 1 MiB parts: room for two spares, not for three
        with caplog.at_level(logging.INFO, logger="tierpoint"):
            manager.warm_up(BasicTensorAwareStateDict(state), wait=True)
        assert 1 <= len(_spares(manager)) < 3
        assert "no room for a spare part file" in caplog.text
        manager.save(BasicTensorAwareStateDict(state), 1)
        ta, ckpt = LocalCheckpointManager(root, session_id="job").load()
        assert ckpt.iteration == 1 and torch.equal(ta.state_dict["w"], state["w"])
        del manager, ta  # their mappings keep the file system busy
        gc.collect()


def test_warm_up_refuses_a_plain_dict(tmp_path):
    with pytest.raises(CheckpointingError, match="TensorAwareStateDict"):
        LocalCheckpointManager(tmp_path).warm_up({"w": torch.ones(2)})  # type: ignore[arg-type]


def test_spare_names_never_collide_when_saves_retire_parts_beside_warm_spares(shm_dir: Path):
    manager = LocalCheckpointManager(shm_dir, session_id="job", keep_last=1)
    manager.warm_up(BasicTensorAwareStateDict(_state(0)), wait=True)
    assert sorted(_spares(manager)) == ["spare_0.free", "spare_1.free"]
    for it in range(1, 6):
        manager.save(BasicTensorAwareStateDict(_state(it)), it)
        assert len(_spares(manager)) <= 2
    ta, ckpt = LocalCheckpointManager(shm_dir, session_id="job").load()
    assert ckpt.iteration == 5 and torch.equal(ta.state_dict["w"], _state(5)["w"])


def test_warm_up_while_an_async_save_is_in_flight_leaves_its_memory_alone(tmp_path):
    manager = LocalCheckpointManager(tmp_path, session_id="job")
    with AsyncCallsQueue() as queue:
        request = manager.save(BasicTensorAwareStateDict(_state(1)), 1, is_async=True)
        staged = manager._stager.buffer
        # another layout: warming it up now would free the buffer the save is about to fill
        manager.warm_up(BasicTensorAwareStateDict(_state(0, rows=64)), wait=True)
        assert manager._stager.buffer is staged
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    ta, ckpt = LocalCheckpointManager(tmp_path, session_id="job").load()
    assert ckpt.iteration == 1 and torch.equal(ta.state_dict["w"], _state(1)["w"])
