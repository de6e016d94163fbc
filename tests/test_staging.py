"""Staging buffers: the snapshot copy, and the checksums computed while copying."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from tierpoint import fileformat, staging, tree
from tierpoint.errors import CheckpointingError


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
        staged = staging.planned_views(buf.tensor, plan)
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
    with pytest.raises(CheckpointingError, match="1 checksums given for 2 tensors"):
        fileformat.write_planned(tmp_path / "p.part", plan, views, checksums=["0" * 16])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("hash_now", [False, True])
def test_a_part_filled_in_place_then_sealed_verifies_and_reads_back(
    tmp_path: Path, hash_now: bool
) -> None:
    flat = tree.flatten(mixed_state())
    plan = fileformat.plan_part(flat, {"iteration": 3})
    path = tmp_path / "p.part"
    # A larger expired file is recycled: its pages are reused and it is cut to the planned size.
    spare = tmp_path / "spare"
    spare.write_bytes(b"\xff" * (plan.file_size() + 12345))
    dirty = fileformat.dirty_name(path)
    size = fileformat.prepare_planned(dirty, plan, recycle=spare)
    assert size == plan.file_size() == dirty.stat().st_size and not spare.exists()
    with open(dirty, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED)
    data = torch.frombuffer(mapping, dtype=torch.uint8)
    section = data[plan.data_start() : plan.data_start() + plan.data_size]
    sums = staging.copy_planned(flat, plan, section, pinned=False, hash=hash_now)
    assert (sums is not None) == hash_now
    result = fileformat.seal_planned(path, plan, checksums=sums)
    assert result.nbytes == plan.file_size() and not dirty.exists()
    assert fileformat.verify(path).extra == {"iteration": 3}
    back = fileformat.read(path)
    for key, value in mixed_state().items():
        assert torch.equal(back[key], value.resolve_conj())
    del data, section
    mapping.close()


def test_sealing_an_unprepared_or_wrong_sized_file_is_refused_and_removes_it(
    tmp_path: Path,
) -> None:
    plan = fileformat.plan_part(tree.flatten({"a": torch.ones(4)}))
    path = tmp_path / "p.part"
    with pytest.raises(FileNotFoundError):
        fileformat.seal_planned(path, plan)
    fileformat.dirty_name(path).write_bytes(b"short")
    with pytest.raises(CheckpointingError, match="not the planned size"):
        fileformat.seal_planned(path, plan)
    assert list(tmp_path.iterdir()) == []


def test_ram_filesystems_are_recognised(tmp_path: Path) -> None:
    assert staging.in_memory_filesystem("/dev/shm")
    assert not staging.in_memory_filesystem(tmp_path / "missing")


def test_a_buffers_views_are_made_once_per_layout_and_dropped_when_it_closes() -> None:
    buf = staging.StagingBuffer(64)
    made: list[str] = []

    def views(key: str) -> object:
        def make(data: torch.Tensor) -> list[torch.Tensor]:
            made.append(key)
            return [data[:8].view(torch.float32)]

        return make

    first = buf.views_for(("a", [1, 2]), views("a"))
    assert buf.views_for(("a", [1, 2]), views("a")) is first  # an equal layout: the same views
    first[0].fill_(2.0)
    assert torch.equal(buf.tensor[:8].view(torch.float32), torch.full((2,), 2.0))
    assert buf.views_for(("b",), views("b")) is not first
    assert made == ["a", "b"]
    buf.close()
    assert buf._views is None  # nothing left that holds the mapping
