"""The worker's jobs: a staged snapshot becomes a complete part file, its checksums computed from
the bytes written, into a recycled spare's pages when there is one."""

from __future__ import annotations

import os

import pytest
import torch

from tierpoint import fileformat
from tierpoint.local.jobs import write_staged_part
from tierpoint.staging import Stager
from tierpoint.tree import flatten

from ..mounts import small_tmpfs
from .helpers import assert_bitwise_equal


def _state(seed: int, big: int = 300_000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(big, generator=g),  # several hash pieces
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0),
        "ids": torch.arange(1000, dtype=torch.int64),
        "step": seed,
    }


def _stage(state: dict) -> tuple[fileformat.PartPlan, Stager]:
    flat = flatten(state)
    plan = fileformat.plan_part(flat, None)
    stager = Stager()
    stager.stage(flat, plan)
    return plan, stager


@pytest.mark.parametrize("spare_size", ["same", "smaller", "larger"])
def test_a_staged_part_goes_into_a_recycled_spare_with_its_checksums(shm_dir, spare_size):
    state = _state(1)
    plan, stager = _stage(state)
    spare = shm_dir / "spare"
    factor = {"same": 1.0, "smaller": 0.5, "larger": 2.0}[spare_size]
    spare.write_bytes(b"\xab" * int(plan.file_size() * factor))  # old bytes the copy overwrites
    inode = spare.stat().st_ino
    path = shm_dir / "part.safetensors"
    nbytes = write_staged_part(str(path), plan, stager.buffer, recycle=str(spare))
    stager.close()
    assert nbytes == plan.file_size() == path.stat().st_size
    assert path.stat().st_ino == inode and not spare.exists()  # the spare's pages, reused
    fileformat.verify(path)
    assert_bitwise_equal(fileformat.read(path), state)
    assert sorted(os.listdir(shm_dir)) == ["part.safetensors"]


def test_without_a_spare_the_staged_part_is_written(shm_dir):
    state = _state(2)
    plan, stager = _stage(state)
    path = shm_dir / "part.safetensors"
    write_staged_part(str(path), plan, stager.buffer, recycle=str(shm_dir / "gone"))
    stager.close()
    assert_bitwise_equal(fileformat.read(path), state)


def test_a_spare_too_small_for_a_full_ram_tier_fails_cleanly(tmp_path):
    state = _state(3, big=2**20)  # 4 MiB > the 1 MiB tmpfs
    plan, stager = _stage(state)
    with small_tmpfs(tmp_path / "tier") as tier:
        spare = tier / "spare"
        spare.write_bytes(b"\0" * 4096)
        with pytest.raises(OSError, match="No space left"):
            write_staged_part(str(tier / "part"), plan, stager.buffer, str(spare))
        assert os.listdir(tier) == []  # the dirty file is gone with the spare's space
    stager.close()
