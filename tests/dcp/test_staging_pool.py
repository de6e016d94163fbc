"""Staging for async DCP saves onto a RAM file system: the snapshot fills the checkpoint file itself
(one per rank), and when that cannot be done the save still commits, staged in memory; a save into
a directory again leaves none of the earlier save's files behind."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.dcp import StagingPool, async_save, async_save_request, save, step_path
from tierpoint.dcp import snapshot as writer  # the snapshot's copying and in-place naming
from tierpoint.dcp.file_plan import RankFiles
from tierpoint.errors import CheckpointingError
from tierpoint.staging import StagingBuffer
from tierpoint.testing import run_ranks

from .file_names import untokened
from .test_writer import assert_same, zeros_like_state

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 70, generator=g), "b": torch.randn(9, generator=g), "n": seed}


def _assert_loads(path: str, expected: dict) -> None:
    """torch's own reader loads ``expected`` from ``path``."""
    out = zeros_like_state(expected)
    dcp.load(out, checkpoint_id=path)
    assert_same(out, expected)


def _save(state: dict, path: str, queue: AsyncCallsQueue, pool: StagingPool) -> dict:
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    future = async_save(state, path, queue=queue, staging_pool=pool)
    state["w"].add_(1)  # training goes on at once
    future.result(timeout=120)
    return expected


def test_a_ram_disk_with_no_room_for_the_staging_file_stages_in_memory(
    shm_dir, monkeypatch, caplog
):
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    pool = StagingPool()
    with AsyncCallsQueue() as queue, caplog.at_level(logging.INFO, logger="tierpoint"):
        for step in (1, 2):
            state = _state(step)
            expected = _save(state, step_path(shm_dir, step), queue, pool)
            _assert_loads(step_path(shm_dir, step), expected)
    assert "no room to stage in place" in caplog.text
    assert pool.allocations == 1 and not pool._free[0][1].file_backed  # one memfd, reused
    assert untokened(os.listdir(step_path(shm_dir, 2))) == [
        ".checksums-0.json",
        ".metadata",
        "__0_0.distcp",
    ]
    pool.close()


def test_when_a_staged_file_cannot_be_named_it_is_copied_and_later_saves_stage_in_memory(
    shm_dir, monkeypatch, caplog
):
    def cannot_link(self: StagingBuffer, path: str) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(StagingBuffer, "link", cannot_link)
    monkeypatch.setattr(writer, "_links_work", True)
    pool = StagingPool()
    assert writer.stages_in_place(str(shm_dir))
    with AsyncCallsQueue() as queue, caplog.at_level(logging.INFO, logger="tierpoint"):
        expected = _save(_state(1), step_path(shm_dir, 1), queue, pool)
        _assert_loads(step_path(shm_dir, 1), expected)
        assert "cannot name staged files" in caplog.text
        assert not writer.stages_in_place(str(shm_dir))
        expected = _save(_state(2), step_path(shm_dir, 2), queue, pool)  # thread_count=2 files
        _assert_loads(step_path(shm_dir, 2), expected)
    names = untokened(os.listdir(step_path(shm_dir, 2)))
    assert names == [".checksums-0.json", ".metadata", "__0_0.distcp", "__0_1.distcp"], names
    pool.close()


def test_a_failed_in_place_snapshot_names_no_file_and_the_next_save_works(shm_dir, monkeypatch):
    def copy_fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("copy failed")

    pool = StagingPool()
    with AsyncCallsQueue() as queue:
        monkeypatch.setattr(writer, "copy_tensors", copy_fails)
        request = async_save_request(_state(1), step_path(shm_dir, 1), staging_pool=pool)
        queue.schedule_async_request(request)
        with pytest.raises(CheckpointingError, match="copy failed"):
            queue.maybe_finalize_async_calls(blocking=True)
        assert not os.path.exists(step_path(shm_dir, 1))
        assert not pool._busy and not pool._free
        monkeypatch.undo()
        expected = _save(_state(2), step_path(shm_dir, 2), queue, pool)
        _assert_loads(step_path(shm_dir, 2), expected)
    pool.close()
    assert pool.bytes_held == 0


def test_overlapping_in_place_snapshots_both_commit(shm_dir, monkeypatch):
    """Two snapshots in flight at once (max_in_flight=2, overlapped): each hands its file over
    and starts preparing a spare; however late a preparing thread starts, neither save fails."""
    start = threading.Thread.start

    def late_start(self: threading.Thread) -> None:
        if self.name == "tierpoint-spare-staging":
            time.sleep(0.3)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", late_start)
    pool = StagingPool()
    states = [_state(1), _state(2)]
    with AsyncCallsQueue(max_in_flight=2, overlap_snapshot=True) as queue:
        futures = [
            async_save(s, step_path(shm_dir, k), queue=queue, staging_pool=pool)
            for k, s in enumerate(states, 1)
        ]
        queue.wait_for_snapshot()
        for f in futures:
            f.result(timeout=120)
    for k, s in enumerate(states, 1):
        _assert_loads(step_path(shm_dir, k), s)
    pool.close()


def test_no_room_for_the_non_tensor_values_names_the_file(shm_dir, monkeypatch):
    def no_room(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    pool = StagingPool()
    with AsyncCallsQueue() as queue:
        monkeypatch.setattr(os, "pwrite", no_room)
        future = async_save(_state(1), step_path(shm_dir, 1), queue=queue, staging_pool=pool)
        with pytest.raises(
            CheckpointingError, match=r"writing .*step-1/__0_0\.[0-9a-f]{12}\.distcp.*ENOSPC"
        ):
            future.result(timeout=120)
        monkeypatch.undo()
        assert not os.path.exists(step_path(shm_dir, 1))
        expected = _save(_state(2), step_path(shm_dir, 2), queue, pool)
        _assert_loads(step_path(shm_dir, 2), expected)
    pool.close()


@pytest.mark.parametrize("where", ["disk", "ram"])
def test_saving_again_with_fewer_files_leaves_none_of_the_earlier_ones(where, tmp_path, shm_dir):
    root = str(tmp_path if where == "disk" else shm_dir)
    path = step_path(root, 1)
    save(_state(1), path, thread_count=2)
    assert untokened(os.listdir(path))[2:] == ["__0_0.distcp", "__0_1.distcp"]
    with AsyncCallsQueue() as queue:
        future = async_save(_state(2), path, queue=queue, thread_count=1, overwrite=True)
        future.result(timeout=120)
    assert untokened(os.listdir(path)) == [".checksums-0.json", ".metadata", "__0_0.distcp"]
    _assert_loads(path, _state(2))


def test_closing_the_pool_while_a_save_is_in_flight_leaves_no_spare(shm_dir, monkeypatch):
    copy = writer.copy_tensors

    def slow_copy(*args: object, **kwargs: object) -> None:
        time.sleep(0.5)  # the pool is closed meanwhile, after the snapshot took its buffer
        copy(*args, **kwargs)

    monkeypatch.setattr(writer, "copy_tensors", slow_copy)
    pool = StagingPool()
    state = _state(1)
    with AsyncCallsQueue(overlap_snapshot=True) as queue:
        future = async_save(state, step_path(shm_dir, 1), queue=queue, staging_pool=pool)
        time.sleep(0.2)
        pool.close()
        future.result(timeout=120)
    assert pool.wait_for_spare(timeout=60) and pool.bytes_held == 0
    _assert_loads(step_path(shm_dir, 1), state)
    with AsyncCallsQueue() as queue:  # the pool works again, with a spare
        expected = _save(_state(2), step_path(shm_dir, 2), queue, pool)
    _assert_loads(step_path(shm_dir, 2), expected)
    assert pool.wait_for_spare(timeout=60) and pool.bytes_held > 0
    pool.close()
    assert pool.bytes_held == 0


def _save_with(rank: int, world: int, path: str, seed: int) -> bool:
    save(_state(seed), path, overwrite=True)
    return True


def test_saving_again_with_fewer_ranks_leaves_none_of_the_earlier_files(tmp_path):
    path = step_path(str(tmp_path), 1)
    assert run_ranks(_save_with, 3, path, 1) == [True] * 3
    assert {"__1_0.distcp", "__2_0.distcp"} <= set(untokened(os.listdir(path)))
    assert run_ranks(_save_with, 1, path, 2) == [True]
    names = os.listdir(path)
    assert ".metadata" in names and not [n for n in names if n.startswith(("__1_", "__2_"))]
    _assert_loads(path, _state(2))


@pytest.mark.parametrize("where", ["disk", "ram"])
def test_steady_saves_make_no_staging_views_in_the_trainer(where, tmp_path, shm_dir, monkeypatch):
    """The views of each tensor's place in the staging memory come with the buffer: made once for
    a reused buffer (disk), in the background with each spare (RAM): none in a steady save."""
    made_by: list[str] = []
    make_views = RankFiles.views

    def counted(self: RankFiles, data: torch.Tensor) -> list[torch.Tensor]:
        made_by.append(threading.current_thread().name)
        return make_views(self, data)

    monkeypatch.setattr(RankFiles, "views", counted)
    root = shm_dir if where == "ram" else str(tmp_path)
    pool = StagingPool()
    state = _state(1)
    with AsyncCallsQueue() as queue:
        for step in range(1, 5):
            expected = _save(state, step_path(root, step), queue, pool)
            _assert_loads(step_path(root, step), expected)
        pool.wait_for_spare(60)
    pool.close()
    assert made_by.count("MainThread") == 1  # for the first save's new buffer only
    spares = made_by.count("tierpoint-spare-staging")
    assert (spares, len(made_by)) == ((0, 1) if where == "disk" else (4, 5))
