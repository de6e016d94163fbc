"""Warming the persistent tier up: ``tierpoint.dcp.warm_up`` prepares the first async save's staging
memory ahead of it (in memory, or in place on a RAM file system), the first save takes it, and what
it saved loads bit for bit with tierpoint and with torch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.dcp import StagingPool, async_save, load, step_path, warm_up

from .test_writer import assert_same, zeros_like_state

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(seed: int, rows: int = 300) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(rows, 70, generator=g), "b": torch.randn(9, generator=g)},
        "optim": {"m": torch.randn(rows, 70, generator=g).to(torch.bfloat16)},
        "n": seed,
    }


def _save_and_check(state: dict, path: str, queue: AsyncCallsQueue, pool: StagingPool) -> None:
    expected = {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "optim": {"m": state["optim"]["m"].clone()},
        "n": state["n"],
    }
    future = async_save(state, path, queue=queue, staging_pool=pool)
    state["model"]["w"].add_(1)  # training goes on at once
    future.result(timeout=120)
    for reader in (load, lambda out, p: dcp.load(out, checkpoint_id=p)):
        out = zeros_like_state(expected)
        reader(out, path)
        assert_same(out, expected)


@pytest.mark.parametrize("where", ["disk", "ram"])
def test_the_first_save_stages_into_the_buffer_prepared_ahead(where, tmp_path, shm_dir):
    root = tmp_path if where == "disk" else shm_dir
    pool = StagingPool()
    state = _state(1)
    warm_up(state, step_path(root, 1), staging_pool=pool)
    assert pool.wait_for_spare(60)
    state_bytes = sum(
        t.numel() * t.element_size() for t in [*state["model"].values(), *state["optim"].values()]
    )
    assert pool.allocations == 1 and pool.bytes_held >= state_bytes
    with AsyncCallsQueue() as queue:
        _save_and_check(state, step_path(root, 1), queue, pool)
        pool.wait_for_spare(60)
        # the save took the warmed buffer: nothing else allocated but the next in-place file
        assert pool.allocations == (1 if where == "disk" else 2)
        assert pool.bytes_held < 2 * state_bytes + (1 << 20)
        _save_and_check(_state(2), step_path(root, 2), queue, pool)
    pool.close()
    assert pool.bytes_held == 0


def test_a_warmed_buffer_too_small_for_the_save_is_left_and_the_save_allocates(tmp_path):
    pool = StagingPool()
    warm_up(_state(1, rows=10), step_path(tmp_path, 1), staging_pool=pool)
    assert pool.wait_for_spare(60)
    with AsyncCallsQueue() as queue:
        _save_and_check(_state(1, rows=3000), step_path(tmp_path, 1), queue, pool)
    assert pool.allocations == 2
    pool.close()
    assert pool.bytes_held == 0


def test_warm_up_takes_torch_dcp_checkpoint_id(tmp_path):
    pool = StagingPool()
    warm_up(_state(1), checkpoint_id=step_path(tmp_path, 1), staging_pool=pool)
    assert pool.wait_for_spare(60) and pool.allocations == 1
    pool.close()


def test_after_warm_up_the_first_save_lays_out_its_files_without_serializing_a_tensor(
    tmp_path, monkeypatch
):
    """warm_up makes each tensor's torch.save record bytes (per dtype and shape) ahead: the first
    save, which lays out its files, finds them made."""
    state = _state(3, rows=317)  # shapes no other test saves
    pool = StagingPool()
    warm_up(state, step_path(tmp_path, 1), staging_pool=pool)
    serialized: list[str] = []
    real_save = torch.save

    def counted(obj: object, *args: object, **kwargs: object) -> None:
        if isinstance(obj, torch.Tensor):
            serialized.append(f"{obj.dtype} {list(obj.shape)}")
        real_save(obj, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counted)
    with AsyncCallsQueue() as queue:
        _save_and_check(state, step_path(tmp_path, 1), queue, pool)
    pool.close()
    assert serialized == []
