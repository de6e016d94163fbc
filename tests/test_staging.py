"""Staging buffers: the snapshot copy, and the checksums computed while copying."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierpoint import fileformat, staging, tree


def mixed_state() -> dict:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(700, 800, generator=g)  # several hashing pieces
    return {
        "big": big,
        "transposed": big[:300, :200].t(),  # not contiguous: copied by torch, then hashed
        "bf16": torch.randn(513, generator=g).to(torch.bfloat16),
        "flags": torch.rand(77, generator=g) > 0.5,
        "complex": torch.randn(9, dtype=torch.complex64, generator=g),
        "conj": torch.randn(5, dtype=torch.complex64, generator=g).conj(),
        "empty": torch.empty(0, 4),
        "step": torch.tensor(11),
    }


def test_stage_and_hash_gives_the_checksums_of_the_staged_bytes(tmp_path: Path) -> None:
    flat = tree.flatten(mixed_state())
    plan = fileformat.plan_part(flat)
    stager = staging.Stager()
    try:
        buf, sums = stager.stage_and_hash(flat, plan)
        staged = buf.views(plan)
        for src, dst, got in zip(flat.tensors, staged, sums):
            assert torch.equal(src.resolve_conj(), dst)
            assert got == fileformat.checksum(fileformat.byte_view(dst))
        # A part written with those checksums verifies, and reads back equal.
        views = [memoryview(buf.tensor.numpy())[b:e] for b, e in plan.offsets]
        fileformat.write_planned(tmp_path / "p.part", plan, views, checksums=sums)
        fileformat.verify(tmp_path / "p.part")
        back = fileformat.read(tmp_path / "p.part")
        for key, value in mixed_state().items():
            assert torch.equal(back[key], value.resolve_conj())
    finally:
        stager.close()


def test_wrong_number_of_checksums_is_refused(tmp_path: Path) -> None:
    flat = tree.flatten({"a": torch.ones(4), "b": torch.zeros(2)})
    plan = fileformat.plan_part(flat)
    views = [fileformat.byte_view(t) for t in flat.tensors]
    with pytest.raises(fileformat.CheckpointingError, match="1 checksums given for 2 tensors"):
        fileformat.write_planned(tmp_path / "p.part", plan, views, checksums=["0" * 16])
    assert list(tmp_path.iterdir()) == []
