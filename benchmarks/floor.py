"""The physical floor shared by the benchmarks: raw writes and reads of tensor bytes, no format.

``raw_write`` puts the tensors' bytes back to back into a new file (one ``os.write`` each, then
``fsync``); ``raw_write_direct`` writes the same file past the page cache (``O_DIRECT`` from a
page-aligned 16 MiB buffer the bytes are copied into; on a disk this is often the faster of the two,
so a benchmark's write floor is the faster one); ``raw_read`` reads them back with ``readinto`` into
preallocated tensors, and ``raw_read_parallel`` with ``preadv`` of 16 MiB pieces on several threads
(a disk may serve several requests in flight faster than one stream: a benchmark's read floor is the
faster of the two).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch


def tensors_of(state: Any) -> list[torch.Tensor]:
    """The tensors of a nested dict state, depth first."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    return []


def nbytes_of(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view) :]


def read_into(f: Any, view: memoryview) -> None:
    while len(view):
        n = f.readinto(view)
        if not n:
            raise EOFError("raw file is shorter than the state")
        view = view[n:]


def preallocate(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Empty tensors like ``tensors``, each page touched so it exists before timing."""
    targets = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    for t in targets:
        t.zero_()
    return targets


def raw_write(path: Path, tensors: Sequence[torch.Tensor]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for t in tensors:
            write_all(fd, tensor_bytes(t))
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write_direct(path: Path, tensors: Sequence[torch.Tensor], chunk: int = 16 << 20) -> None:
    buf = mmap.mmap(-1, chunk)
    space = memoryview(buf)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        filled = offset = 0
        for t in tensors:
            view = tensor_bytes(t)
            while len(view):
                take = min(len(view), chunk - filled)
                space[filled : filled + take] = view[:take]
                filled, view = filled + take, view[take:]
                if filled == chunk:
                    os.pwrite(fd, space, offset)
                    offset, filled = offset + chunk, 0
        if filled:
            padded = -(-filled // 4096) * 4096
            space[filled:padded] = bytes(padded - filled)
            os.pwrite(fd, space[:padded], offset)
            os.ftruncate(fd, offset + filled)
        os.fsync(fd)
    finally:
        os.close(fd)
        space.release()
        buf.close()


def raw_read(path: Path, targets: Sequence[torch.Tensor]) -> None:
    with open(path, "rb", buffering=0) as f:
        for t in targets:
            read_into(f, tensor_bytes(t))


def raw_read_parallel(
    path: Path, targets: Sequence[torch.Tensor], threads: int = 4, piece: int = 16 << 20
) -> None:
    views, offset = [], 0
    for t in targets:
        view = tensor_bytes(t)
        for begin in range(0, len(view), piece):
            views.append((view[begin : begin + piece], offset + begin))
        offset += len(view)

    def read(job: tuple[memoryview, int]) -> None:
        view, at = job
        while len(view):
            n = os.preadv(fd, [view], at)
            if not n:
                raise EOFError("raw file is shorter than the state")
            view, at = view[n:], at + n

    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, views))
    finally:
        os.close(fd)
