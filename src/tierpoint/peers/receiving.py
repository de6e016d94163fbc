"""Receiving a file atomically: into ``<dst>.dirty``, sized up front, committed only when checked.

Call order: :func:`~tierpoint.peers.transfer.move_files` opens a :class:`Target` per received file
(:func:`open_target`), lets the bytes land in its mapping, then calls :func:`commit` (checks
finished, fsync, rename, directory fsync); a failed move's target is unlinked by the caller.

Invariants: a received file becomes visible only verified and durable; any failure removes the
dirty file and never leaves a partial file under the destination's name; the space is reserved
before any byte arrives (a full disk fails now, not as SIGBUS while receiving).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..files import dirty_name, fsync_dir, open_own, reserve
from ..files import unlink_quietly as _unlink
from .checks import ReceiveCheck
from .mapping_cache import Mapper
from .moves import FileMove


@dataclass
class Target:
    """A file being received: its mapping, the same bytes as a tensor and a memoryview, its path."""

    mapping: mmap.mmap | None
    tensor: torch.Tensor
    dirty: Path
    memory: memoryview

    def close(self, mapper: Mapper, keep: bool = True) -> None:
        self.memory.release()
        entry = (self.mapping, self.tensor)
        if keep:
            mapper.done(entry)
        else:
            mapper.forget(entry)


def open_target(
    dst_path: str, nbytes: int, spare: str | None, mapper: Mapper, mode: int = 0o600
) -> Target:
    """The dirty file a received file is written into, sized and mapped, with ``mode``."""
    dirty = dirty_name(dst_path)
    dirty.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if spare is not None:
        os.replace(spare, dirty)
    fd = open_own(dirty, os.O_RDWR | os.O_CREAT | (0 if spare else os.O_TRUNC), mode)
    try:
        reserve(fd, nbytes)  # ENOSPC now, not as SIGBUS while receiving
    except OSError:
        os.close(fd)
        _unlink(dirty)
        raise
    os.close(fd)
    m_map, view = mapper.map(str(dirty), nbytes, writable=True)
    return Target(m_map, view, dirty, memoryview(m_map) if m_map is not None else memoryview(b""))


def commit(
    move: FileMove,
    target: Target,
    checks: Sequence[ReceiveCheck],
    mapper: Mapper,
) -> None:
    """Finish the checks, then make the file durable and visible (fsync covers the mapped writes)."""
    dirty = target.dirty
    try:
        for check in checks:
            check.finish()
        target.close(mapper)
        fd = os.open(dirty, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(dirty, move.dst_path)
        fsync_dir(Path(move.dst_path).parent)
    except BaseException:
        _unlink(dirty)
        try:
            target.close(mapper, keep=False)
        except (BufferError, ValueError):  # pragma: no cover - a view still in use: left to the GC
            pass
        raise
