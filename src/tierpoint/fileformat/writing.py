"""Writing part files: complete under their final name, or not there at all.

Call order, one of:

- ``write(path, state)`` / ``write_flat(path, flat)``: plan, write, hash and seal in one call;
- ``write_planned(path, plan, views)``: the bytes are given (e.g. slices of a staging buffer);
- ``prepare_planned(dirty, plan)``, fill the data section through a mapping, then
  ``seal_planned(path, plan)``: the snapshot is copied straight into the file (RAM tier).

Invariants: data goes to a dirty name (:func:`dirty_name`); the header goes last, then fsync, rename,
directory fsync; any failure removes the dirty file. A recycled file (an expired part whose pages are
reused) is never one whose pages loaded tensors still map (:func:`tierpoint.fileformat.is_mapped`).
Space for in-place filling is reserved up front, so a full disk fails with ENOSPC, not SIGBUS.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ..errors import CheckpointingError
from ..files import SMALL, dirty_name, fsync_dir, open_own, reserve, unlink_quietly, write_all
from ..files import write_views as _write_data  # looked up at each call: crash tests replace it
from ..tree import FlatState, flatten
from .plan import PartPlan, plan_part
from .reading import is_mapped
from .tensor_bytes import HASH_CHUNK, ChunkHasher, byte_view, cpu_contiguous, mapped_checksums


@dataclass(frozen=True)
class PartWritten:
    """A part file written: where, how many bytes, how long it took."""

    path: str
    nbytes: int
    seconds: float


def _write_and_hash(fd: int, views: Sequence[memoryview]) -> list[str]:
    """Write the views back to back and return their checksums (see :class:`ChunkHasher`); small
    views are gathered into few writes."""
    hashers = [xxhash.xxh3_64() for _ in views]
    chunks = ChunkHasher()
    try:
        small: list[memoryview] = []
        for v, hasher in zip(views, hashers):
            if len(v) < SMALL:
                small.append(v)
                hasher.update(v)
                continue
            _write_data(fd, small)
            small = []
            for offset in range(0, len(v), HASH_CHUNK):
                piece = v[offset : offset + HASH_CHUNK]
                write_all(fd, piece)
                chunks.update(hasher, piece)
        _write_data(fd, small)
        chunks.drain()
    finally:
        chunks.close()
    return [h.hexdigest() for h in hashers]


def write(
    path: str | os.PathLike,
    state: Any,
    *,
    allow_pickle: bool = False,
    extra: Mapping[str, Any] | None = None,
    recycle: str | os.PathLike | None = None,
    dirty_path: str | os.PathLike | None = None,
    fsync: bool = True,
    mode: int = 0o600,
) -> PartWritten:
    """Write ``state`` (any nested dict/list/tuple of tensors and plain values) as a part file."""
    return write_flat(
        path,
        flatten(state, allow_pickle=allow_pickle),
        extra=extra,
        recycle=recycle,
        dirty_path=dirty_path,
        fsync=fsync,
        mode=mode,
    )


def write_flat(
    path: str | os.PathLike,
    flat: FlatState,
    *,
    extra: Mapping[str, Any] | None = None,
    plan: PartPlan | None = None,
    recycle: str | os.PathLike | None = None,
    dirty_path: str | os.PathLike | None = None,
    fsync: bool = True,
    mode: int = 0o600,
) -> PartWritten:
    """Write a flattened state to ``path`` through a dirty name (see module invariants).

    ``plan`` is ``plan_part(flat, extra)`` when the caller already made it (``extra`` is then unused).
    ``recycle`` names an expired part file whose pages are reused for this one (rewriting an existing
    tmpfs file is several times faster than filling a new one); the caller guarantees nothing needs it.
    ``mode``: a new file's permissions, less the umask (private by default, as the local tier's
    parts are; 0o644 for a file shared as torch's files are).
    """
    plan = plan if plan is not None else plan_part(flat, extra)
    views = [byte_view(cpu_contiguous(t)) for t in flat.tensors]
    return write_planned(
        path, plan, views, recycle=recycle, dirty_path=dirty_path, fsync=fsync, mode=mode
    )


def write_planned(
    path: str | os.PathLike,
    plan: PartPlan,
    views: Sequence[memoryview],
    *,
    recycle: str | os.PathLike | None = None,
    dirty_path: str | os.PathLike | None = None,
    fsync: bool = True,
    checksums: Sequence[str] | None = None,
    mode: int = 0o600,
) -> PartWritten:
    """Write a planned part: ``views`` are each tensor's bytes (skeleton order), e.g. slices of a
    staging buffer laid out as planned; ``checksums`` (same order), when the caller computed them
    from these very bytes already, spare the hashing pass."""
    start = time.perf_counter()
    path = Path(path)
    dirty = Path(dirty_path) if dirty_path is not None else dirty_name(path)
    order = plan.file_order
    if _recycled_as(recycle, dirty):
        fd = open_own(dirty, os.O_WRONLY)
    else:  # (a link under the dirty name, a leftover, is replaced, never written through)
        fd = open_own(dirty, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.lseek(fd, plan.data_start(), os.SEEK_SET)
        if checksums is not None:
            _check_count(checksums, plan)
            _write_data(fd, [views[i] for i in order])
            sums = list(checksums)
        else:
            ordered = _write_and_hash(fd, [views[i] for i in order])
            sums = [""] * len(views)
            for i, h in zip(order, ordered):
                sums[i] = h
        os.ftruncate(fd, plan.file_size())
    except BaseException:
        os.close(fd)
        unlink_quietly(dirty)
        raise
    return _seal(fd, dirty, path, plan, sums, fsync, start)


def _recycled_as(recycle: str | os.PathLike | None, dirty: Path) -> bool:
    """Rename an expired file to ``dirty`` so that its pages are reused; False when there is none
    (or its pages are mapped copy-on-write by loaded tensors)."""
    if recycle is None or not os.path.exists(recycle) or is_mapped(recycle):
        return False
    os.replace(recycle, dirty)
    return True


def prepare_planned(
    dirty_path: str | os.PathLike, plan: PartPlan, recycle: str | os.PathLike | None = None
) -> int:
    """Make ``dirty_path`` a file of the planned part's size whose data section a caller then fills
    in place (through a shared mapping) before :func:`seal_planned`; returns the file size.

    ``recycle`` names an expired file whose pages are reused. Space is reserved here, so a full
    disk fails now with ENOSPC instead of as SIGBUS while the mapping is written.
    """
    dirty = Path(dirty_path)
    total = plan.file_size()
    _recycled_as(recycle, dirty)
    fd = open_own(dirty, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        reserve(fd, total)
    except BaseException:
        unlink_quietly(dirty)
        raise
    finally:
        os.close(fd)
    return total


def seal_planned(
    path: str | os.PathLike,
    plan: PartPlan,
    *,
    dirty_path: str | os.PathLike | None = None,
    fsync: bool = True,
    checksums: Sequence[str] | None = None,
) -> PartWritten:
    """Finish a part whose data section was written in place (see :func:`prepare_planned`): hash it
    unless ``checksums`` are given, write the header, fsync and rename the dirty file to ``path``."""
    start = time.perf_counter()
    path = Path(path)
    dirty = Path(dirty_path) if dirty_path is not None else dirty_name(path)
    fd = os.open(dirty, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != plan.file_size():
            raise CheckpointingError(f"{dirty}: not the planned size; was it prepared?")
        if checksums is not None:
            _check_count(checksums, plan)
            sums = list(checksums)
        else:
            sums = _hash_planned(fd, plan)
    except BaseException:
        os.close(fd)
        unlink_quietly(dirty)
        raise
    return _seal(fd, dirty, path, plan, sums, fsync, start)


def _hash_planned(fd: int, plan: PartPlan) -> list[str]:
    """Each planned tensor's checksum, read through a mapping of the file (no copy)."""
    return mapped_checksums(fd, plan.file_size(), plan.data_start(), plan.offsets)


def _check_count(checksums: Sequence[str], plan: PartPlan) -> None:
    if len(checksums) != len(plan.offsets):
        raise CheckpointingError(
            f"{len(checksums)} checksums given for {len(plan.offsets)} tensors"
        )


def _seal(
    fd: int,
    dirty: Path,
    path: Path,
    plan: PartPlan,
    sums: Sequence[str],
    fsync: bool,
    start: float,
) -> PartWritten:
    """Write the header of a part whose data is in place, fsync, close ``fd``, rename to ``path``."""
    try:
        header = plan.header(sums)
        if len(header) != plan.header_size():  # pragma: no cover - fixed-width checksum fields
            raise CheckpointingError("internal error: header length changed while writing")
        os.pwrite(fd, struct.pack("<Q", len(header)) + header, 0)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quietly(dirty)
        raise
    os.close(fd)
    try:
        os.replace(dirty, path)
    except BaseException:  # (``path`` is a directory, its parent is gone): no dirty file is left
        unlink_quietly(dirty)
        raise
    if fsync:
        fsync_dir(path.parent)
    return PartWritten(str(path), plan.file_size(), time.perf_counter() - start)
