"""Raw tensor bytes: zero-copy views, xxh3-64 checksums, and hashing that keeps pace with copying.

A part file stores each tensor's bytes as they lie in memory and records their xxh3-64 checksum.
This module is the one place those bytes are viewed and hashed: :func:`byte_view` (no copy),
:func:`checksum`, :class:`ChunkHasher` (hash each chunk on a background thread just after it was
written or read, while it is still in the CPU cache) and :func:`mapped_checksums` (hash ranges of a
file from a read-only mapping on two threads, no copy into process memory).

Invariant: every checksum a part file holds or is checked against comes from :func:`checksum` (or an
``xxhash.xxh3_64`` fed the same bytes in order), so writers, readers and receivers agree.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xxhash

IO_CHUNK = 1 << 30
"""Largest single read or write (Linux moves at most ~2 GiB per call)."""


def cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor holding ``t``'s values as plain bytes (a copy only where unavoidable:
    another device, a non-contiguous layout, or a lazy conjugate / negative view)."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    flat = t.as_strided((t.numel(),), (1,))  # not reshape: it keeps a size-1 dim's odd stride
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def checksum(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


HASH_CHUNK = 4 << 20
"""Bytes hashed per background task: small enough to still be in the CPU cache."""


class ChunkHasher:
    """Hashes chunks on one background thread, in submission order, while the caller moves the next
    chunk: each chunk is hashed just after it was copied (still in the CPU cache), and the two
    cores share the work when both are free."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierpoint-hash")
        self._pending: list[Future[None]] = []

    def update(self, hasher: Any, piece: memoryview) -> None:
        self._pending.append(self._pool.submit(hasher.update, piece))
        if len(self._pending) > 64:
            self._pending.pop(0).result()

    def drain(self) -> None:
        for fut in self._pending:
            fut.result()
        self._pending.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def mapped_checksums(
    fd: int, file_size: int, data_start: int, ranges: Sequence[tuple[int, int]]
) -> list[str]:
    """The checksum of each ``(begin, end)`` range of a file's data section, hashed from a read-only
    mapping on two threads (no copy into process memory)."""
    if file_size == 0:
        return [checksum(b"") for _ in ranges]
    mapping = mmap.mmap(
        fd,
        file_size,
        flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
        prot=mmap.PROT_READ,
    )
    try:
        with memoryview(mapping) as whole:
            return range_checksums(whole, data_start, ranges)
    finally:
        mapping.close()


def range_checksums(
    data: memoryview, data_start: int, ranges: Sequence[tuple[int, int]], threads: int = 2
) -> list[str]:
    """The checksum of each ``(begin, end)`` range of ``data[data_start:]``, on ``threads`` threads
    (xxhash releases the GIL)."""

    def digest(span: tuple[int, int]) -> str:
        with data[data_start + span[0] : data_start + span[1]] as part:
            return checksum(part)

    with ThreadPoolExecutor(threads, thread_name_prefix="tierpoint-verify") as pool:
        return list(pool.map(digest, ranges))
