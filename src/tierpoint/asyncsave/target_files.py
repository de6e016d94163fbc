"""Files a job fills or hashes through a shared mapping, kept mapped in the worker for the next job
on the same file.

Checkpoint files circulate: an expired part becomes a spare that the next save fills again, so a
handful of files (the same inodes) are filled in turn. Mapping a file and faulting its pages in, then
unmapping it, costs about 0.1 s per GB on tmpfs, as much as copying the bytes with a few threads;
a mapping kept from one save to the next costs it once per file.
(:class:`tierpoint.peers.MappingCache` keeps mappings too, but its owner tells it which files
remain; nobody tells the worker, so it holds each file's descriptor and asks the file itself
whether it still has a name.)

Call order: a job calls ``with mapped_file(path, nbytes) as data:`` and fills or reads ``data`` (a
writable byte tensor over the whole file). Only in the worker process (:func:`keep_mappings`, called once at
its start) is the mapping kept afterwards; elsewhere it is unmapped when the block ends. The worker
calls :func:`sweep` while idle (about once a second) and before each call.

Invariants: a kept mapping is handed out again only for the same file (device and inode), whose
size is still ``nbytes``; a file whose last name was removed loses its mapping at the next sweep or
use, so the worker holds a deleted file's pages (RAM, on tmpfs) for about a second at most; a block
that raised never keeps its mapping; at most :data:`MAX_KEPT` mappings are kept.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections import OrderedDict
from collections.abc import Iterator

import torch

from ..errors import CheckpointingError

MAX_KEPT = 8
"""Mappings kept at most (own parts in flight and kept, with room for a layout change)."""

_kept: OrderedDict[tuple[int, int], tuple[int, mmap.mmap]] = OrderedDict()
_keeping = False


def keep_mappings(keep: bool = True) -> None:
    """Keep mappings after use in this process (the worker's, which sweeps them); ``False``: unmap
    every kept one and keep none from now on."""
    global _keeping
    _keeping = keep
    while not keep and _kept:
        _drop(_kept.popitem()[1])


@contextlib.contextmanager
def mapped_file(path: str | os.PathLike, nbytes: int) -> Iterator[torch.Tensor]:
    """``path`` (``nbytes`` long, more than 0: else :class:`CheckpointingError`) mapped shared and
    writable, its pages faulted in, as a uint8 tensor valid inside the block only."""
    fd = os.open(path, os.O_RDWR)
    st = os.fstat(fd)
    if st.st_size != nbytes:  # touching a mapping past the end of the file would be SIGBUS
        os.close(fd)
        raise CheckpointingError(f"{path}: {st.st_size} bytes where {nbytes} were planned")
    key = (st.st_dev, st.st_ino)
    kept = _kept.pop(key, None)
    if kept is not None and len(kept[1]) == nbytes:
        os.close(fd)
        fd, mapping = kept
    else:
        if kept is not None:
            _drop(kept)
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
    keep = False
    try:
        yield torch.frombuffer(mapping, dtype=torch.uint8)
        keep = _keeping
    finally:
        if keep:
            _kept[key] = (fd, mapping)
            while len(_kept) > MAX_KEPT:
                _drop(_kept.popitem(last=False)[1])
        else:
            _drop((fd, mapping))


def sweep() -> None:
    """Unmap the kept files that were deleted or changed size."""
    for key, (fd, mapping) in list(_kept.items()):
        try:
            st = os.fstat(fd)
            alive = st.st_nlink > 0 and st.st_size == len(mapping)
        except OSError:
            alive = False
        if not alive:
            _drop(_kept.pop(key))


def kept_count() -> int:
    return len(_kept)


def _drop(entry: tuple[int, mmap.mmap]) -> None:
    fd, mapping = entry
    try:
        mapping.close()
    finally:
        os.close(fd)
