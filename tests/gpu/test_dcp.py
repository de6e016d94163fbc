"""The persistent tier with CUDA states: ``tierpoint.dcp.async_save`` snapshots (training changes the
state right after), and the checkpoint loads bit for bit with tierpoint and with plain torch DCP,
into CUDA tensors."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from tierpoint import dcp
from tierpoint.asyncsave import AsyncCallsQueue

from .helpers import (
    DEVICE,
    assert_same,
    clone,
    cuda_still_works,
    model_state,
    needs_gpu,
    odd_state,
    scribble,
)

pytestmark = needs_gpu
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@pytest.fixture(scope="module")
def queue():
    """One queue (and worker process) for this module's saves: a worker started per test would
    take most of their time on a GPU machine."""
    with AsyncCallsQueue() as shared:
        yield shared


def _zeros_like(state: object) -> object:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    return -1


def _save_and_check(state: dict, path: str, queue: AsyncCallsQueue, pool: dcp.StagingPool) -> None:
    """Save ``state`` asynchronously, change it at once, and load the checkpoint back with
    tierpoint and with plain torch DCP: both give the state as it was at the save."""
    want = clone(state)
    future = dcp.async_save(state, path, queue=queue, staging_pool=pool)
    scribble(state)
    assert future.result(timeout=300) == path
    mine = _zeros_like(want)
    dcp.load(mine, path)
    assert_same(mine, want)
    theirs = _zeros_like(want)
    torch_dcp.load(theirs, checkpoint_id=path)
    assert_same(theirs, want)


@pytest.mark.parametrize("where", ["disk", "ram"])
def test_async_save_of_cuda_tensors_loads_with_tierpoint_and_torch(tmp_path, shm_dir, where, queue):
    base = tmp_path if where == "disk" else shm_dir
    pool = dcp.StagingPool()
    for step in (1, 2, 3):
        _save_and_check(model_state(step), dcp.step_path(base, step), queue, pool)
    pool.close()
    cuda_still_works()


@pytest.mark.parametrize("where", ["disk", "ram"])
def test_views_tied_tensors_and_small_dtypes_load_with_tierpoint_and_torch(
    tmp_path, shm_dir, where, queue
):
    base = tmp_path if where == "disk" else shm_dir
    pool = dcp.StagingPool()
    for step in (1, 2):
        _save_and_check(odd_state(step), dcp.step_path(base, step), queue, pool)
    pool.close()
    cuda_still_works()


@pytest.mark.parametrize("where", ["disk", "ram"])
def test_warm_up_pins_ahead_and_the_first_async_save_takes_its_buffer(
    tmp_path, shm_dir, where, queue
):
    base = tmp_path if where == "disk" else shm_dir
    pool = dcp.StagingPool()
    state = model_state(4)
    dcp.warm_up(state, dcp.step_path(base, 4), staging_pool=pool)
    assert pool.wait_for_spare(120) and pool.allocations == 1
    _save_and_check(state, dcp.step_path(base, 4), queue, pool)
    pool.wait_for_spare(120)
    # CUDA states stage in memory; CPU ones (TIERPOINT_TEST_DEVICE=cpu) in place on a RAM disk,
    # where the pool then prepares the next save's file: either way the warmed buffer was taken
    assert pool.allocations == (2 if where == "ram" and DEVICE == "cpu" else 1)
    pool.close()
    cuda_still_works()
