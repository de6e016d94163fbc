"""Staging buffers: shared host memory laid out as a part file's data section, reused across saves.

Call order: ``stager.stage(flat, plan)`` copies the state's tensors into a :class:`StagingBuffer` laid
out as ``plan`` (one memcpy per tensor; this is the only part of an async save the training thread
pays for) and returns the buffer; a worker process maps the same memory (its ``fd`` is passed over a
Unix socket) and writes it to a file in one piece. ``stager.stage_and_hash(flat, plan)`` also returns
each tensor's checksum, computed piece by piece right after each piece is copied, while the bytes
are still in the CPU cache (for a snapshot taken off the training thread: the worker then only
writes, one memory pass less). Both copy with :func:`copy_planned`, which also copies into memory
the caller owns: when checkpoints live on a RAM file system (:func:`in_memory_filesystem`), the
shared mapping of the part file itself (page-locked by its owner for CUDA tensors), so that the part
file is the staging memory and the worker has nothing left to write but the header. Each takes an
``image`` where the state comes from a device snapshot laid out as the plan's data section
(:attr:`tierpoint.device_snapshot.Ticket.image`): its tensors then arrive in one copy.
``stager.warm(plan, device)``, called ahead of the first save
(from a background thread, see :meth:`tierpoint.local.LocalCheckpointManager.warm_up`), allocates,
faults in and pins the buffer, so that the first save costs what a steady one does. A
:class:`SourceFile` stands in for a staging buffer when the state's tensors already view the pages
of a file whose bytes stay as they are (a committed local part): the worker maps the file read-only
and reads the tensors' bytes from it; the snapshot copies nothing.

Invariants:
- A stager's buffer is allocated once per size of the data section and reused while it is
  unchanged; host memory stays flat across saves. Another size allocates a new buffer and frees
  the old one (callers guarantee, through back-pressure, that no save still reads it). The views
  of the tensors' places in a buffer are made once per layout (:meth:`StagingBuffer.views_for`).
- The memory is an anonymous ``memfd``, or (for DCP saves onto a RAM file system) an unnamed
  ``O_TMPFILE`` there: nothing to clean up in /dev/shm, freed when the last process holding it exits,
  crashed or not, unless it was given a name on purpose (:meth:`StagingBuffer.link`).
- Page-locked memory has one owner: a buffer for a state with CUDA tensors is pinned once, before
  the first copy into it (not at every save), through :class:`tierpoint.pinning.PinnedRange`, and
  unpinned before its memory is unmapped on every path: ``close`` (a layout change, a pool freeing it) and
  garbage collection or interpreter exit (a ``weakref.finalize`` that holds the mapping). A buffer
  that could not be pinned is used unpinned.
- Copies are :mod:`tierpoint.snapshot_copy`'s (the one engine both tiers use).
- A :class:`SourceFile` maps only addresses its owner keeps alive, and only plain bytes (a tensor
  that is not, or lies outside its regions, has no place in it: the caller copies it instead).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import itertools
import mmap
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .fileformat import DTYPES, PartPlan
from .files import in_memory_filesystem as in_memory_filesystem  # re-exported
from .pinning import PinnedRange, copy_device
from .snapshot_copy import Streams, copy_tensors, plain_bytes
from .tree import FlatState

_ids = itertools.count(1)


class StagingBuffer:
    """``nbytes`` of shared memory, visible as a uint8 tensor and to other processes through ``fd``.

    With ``directory`` (on a RAM file system) the memory is an unnamed file of that file system
    (``O_TMPFILE``), allocated and mapped in full up front, which :meth:`link` later turns into a
    named file there without copying; it vanishes like a memfd if the process dies unlinked.
    """

    def __init__(self, nbytes: int, directory: str | os.PathLike | None = None) -> None:
        self.id = f"{os.getpid()}-{next(_ids)}"
        self.nbytes = nbytes
        self.file_backed = directory is not None
        if directory is None:
            self.fd = os.memfd_create(f"tierpoint-staging-{self.id}", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, max(nbytes, 1))
        else:
            self.fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o644)
            try:
                os.posix_fallocate(self.fd, 0, max(nbytes, 1))  # ENOSPC here, not as SIGBUS later
            except OSError:
                os.close(self.fd)
                raise
        self._map = mmap.mmap(self.fd, max(nbytes, 1), flags=mmap.MAP_SHARED)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes]
        self._populated = False
        if directory is not None:
            self.populate()
        self._pin = PinnedRange()
        # Holds the mapping, so the mapping outlives the range's release, whoever drops the buffer.
        self._free = weakref.finalize(self, _unmap, self._pin, self._map, self.fd)
        self._views: tuple[Any, list[torch.Tensor]] | None = None

    def populate(self) -> None:
        """Fault every page of the buffer in, writable, now (else the first copy into each page
        allocates and zeroes it); once."""
        if self.nbytes and not self._populated:
            _populate(self._map, self.tensor.data_ptr())
        self._populated = True

    def prepare(self, device: int | None) -> None:
        """Everything the first copy into a fresh buffer would otherwise pay for, now: its pages
        faulted in, and pinned for copies from ``device`` (see :meth:`pin`)."""
        self.populate()
        self.pin(device)

    def pin(self, device: int | None) -> bool:
        """Page-lock the buffer for copies from ``device`` (a CUDA index; None: nothing to pin for),
        at most once per buffer; True if it is pinned."""
        if device is None:
            return self.pinned
        return self._pin.register(self.tensor.data_ptr(), self.nbytes, device)

    @property
    def pinned(self) -> bool:
        return self._pin.pinned

    @property
    def pinned_for(self) -> int | None:
        """The CUDA device the buffer is pinned for (None: not pinned)."""
        return self._pin.device

    def views_for(
        self, layout: Any, make: Callable[[torch.Tensor], list[torch.Tensor]]
    ) -> list[torch.Tensor]:
        """``make(self.tensor)``: views of the places of a layout's tensors in the buffer, made on
        the first call for ``layout`` (any key that identifies it) and returned as they are while
        it is unchanged: a steady save makes no views."""
        held = self._views
        if held is None or not (held[0] is layout or held[0] == layout):
            held = self._views = (layout, make(self.tensor))
        return held[1]

    def link(self, path: str | os.PathLike) -> None:
        """Give a file-backed buffer the name ``path`` (same file system; an existing file there is
        replaced). The buffer's memory is then that file's content."""
        if not self.file_backed:
            raise ValueError("only a file-backed staging buffer can be linked")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if _libc().linkat(self.fd, b"", _AT_FDCWD, os.fsencode(path), _AT_EMPTY_PATH) == 0:
            return
        # Unprivileged on older kernels: through /proc (which fails across stacked mounts).
        os.link(f"/proc/self/fd/{self.fd}", path, follow_symlinks=True)

    def close(self) -> None:
        """Unpin, unmap and close the buffer (idempotent)."""
        self.__dict__.pop("tensor", None)
        self._views = None
        self._free()


class SourceFile:
    """A read-only file whose bytes some of the caller's tensors view, shared with the worker by
    descriptor in place of a staging buffer: a job reads those tensors' bytes from the file itself
    (mapped read-only there, :func:`tierpoint.asyncsave.worker.resolve_buffer`), so the snapshot
    copies nothing.

    ``fd``: the file, open for reading (duplicated: the caller keeps its own descriptor).
    ``regions``: ``(address, length, offset)``: the ``length`` bytes at ``address`` in this process
    are the file's bytes at ``offset``. ``owner``: what keeps that memory alive (the tensors), held
    until :meth:`close`, so that no other memory takes those addresses meanwhile. The caller
    guarantees that the file's bytes do not change until every job reading them has finished (the
    local tier holds its part, see :meth:`tierpoint.local.LocalCheckpointManager.hold_own_part`).
    """

    def __init__(self, fd: int, regions: Iterable[tuple[int, int, int]], owner: Any = None) -> None:
        self.id = f"{os.getpid()}-{next(_ids)}"
        self.fd = os.dup(fd)
        self.nbytes = os.fstat(self.fd).st_size
        self._regions = sorted((a, n, o) for a, n, o in regions if n > 0)
        if any(o < 0 or o + n > self.nbytes for _, n, o in self._regions):
            os.close(self.fd)
            raise ValueError("a region lies outside the file")
        self._starts = [a for a, _, _ in self._regions]
        self._owner = owner
        self._map: mmap.mmap | None = None
        self._close_fd = weakref.finalize(self, os.close, self.fd)  # dropped unclosed: no leak

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where ``t``'s bytes lie in the file (``None``: not inside one region, or not plain
        bytes, see :func:`tierpoint.snapshot_copy.plain_bytes`)."""
        if not plain_bytes(t):
            return None
        at, n = t.data_ptr(), t.numel() * t.element_size()
        k = bisect.bisect_right(self._starts, at) - 1
        if k < 0:
            return None
        address, length, offset = self._regions[k]
        return offset + at - address if at + n <= address + length else None

    def view(self) -> memoryview:
        """The file's bytes, mapped read-only in this process (a job run here, not in a worker)."""
        if self._map is None:
            self._map = mmap.mmap(self.fd, max(self.nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ)
        return memoryview(self._map)[: self.nbytes]

    def close(self) -> None:
        """Close the descriptor and the mapping, let the owner go (idempotent)."""
        self._owner = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # views alive: unmapped when they go
                self._map.close()
            self._map = None
        self._close_fd()


def _unmap(pinned: PinnedRange, mapping: mmap.mmap, fd: int) -> None:
    pinned.release()  # first: the address range may be mapped again by anything afterwards
    try:
        mapping.close()
    except BufferError:  # views still alive somewhere: the mapping goes when they do
        pass
    os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_AT_FDCWD, _AT_EMPTY_PATH = -100, 0x1000
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not named by Python 3.11's mmap module


def _populate(m: mmap.mmap, address: int) -> None:
    """Fault every page of a fresh shared file mapping in, writable, now (the kernel zeroes them
    here, not during the snapshot copy); by touching each page where the kernel is too old. Through
    ctypes, which lets other threads run meanwhile (``mmap.madvise`` holds the GIL)."""
    if _libc().madvise(address, len(m), _MADV_POPULATE_WRITE) == 0:
        return
    view = memoryview(m)
    for at in range(0, len(m), mmap.PAGESIZE):
        view[at] = 0
    view.release()


def planned_views(data: torch.Tensor, plan: PartPlan) -> list[torch.Tensor]:
    """One tensor per planned tensor, viewing its place in ``data`` (uint8, laid out as ``plan``'s
    data section)."""
    return [planned_view(data, plan, k) for k in range(len(plan.offsets))]


def planned_view(data: torch.Tensor, plan: PartPlan, k: int) -> torch.Tensor:
    """The ``k``-th planned tensor's place in ``data`` (see :func:`planned_views`)."""
    (begin, end), dtype = plan.offsets[k], DTYPES[plan.dtypes[k]]
    if end == begin:
        return torch.empty(plan.shapes[k], dtype=dtype)
    return data[begin:end].view(dtype).view(plan.shapes[k])


def copy_planned(
    flat: FlatState,
    plan: PartPlan,
    data: torch.Tensor,
    pinned: bool,
    hash: bool = False,
    after: Streams | None = None,
    image: torch.Tensor | None = None,
    views: Callable[[], list[torch.Tensor]] | None = None,
) -> list[str] | None:
    """Copy ``flat``'s tensors into ``data`` (uint8, laid out as ``plan``'s data section; pinned or
    not); ``hash``: also return their checksums (None when some come from a device: the worker
    hashes those). ``image``: ``flat``'s tensors on one device as one buffer laid out as the data
    section (:attr:`tierpoint.device_snapshot.Ticket.image`): copied whole, then the tensors on
    other devices over their places in it; no checksums then (the worker hashes). A host image
    is copied tensor by tensor where checksums are asked for: each is hashed as it is copied (one
    pass over the memory, not two). ``views``: gives ``planned_views(data, plan)``, kept by the
    caller (made once per memory and layout), when they are needed."""
    if image is None or (hash and image.device.type != "cuda"):
        targets = views() if views is not None else planned_views(data, plan)
        return copy_tensors(flat.tensors, targets, pinned, hash, after)
    copy_tensors([image], [data[: plan.data_size]], pinned, after=after)
    rest = [k for k, t in enumerate(flat.tensors) if t.device != image.device]
    if rest:
        views = [planned_view(data, plan, k) for k in rest]
        copy_tensors([flat.tensors[k] for k in rest], views, pinned)
    return None


def _views(buf: StagingBuffer, plan: PartPlan) -> Callable[[], list[torch.Tensor]] | None:
    """``planned_views`` of ``buf`` for ``plan``, made once per buffer and layout."""
    key = plan.layout_key
    if key is None:
        return None
    return lambda: buf.views_for(key, lambda data: planned_views(data, plan))


class Stager:
    """Keeps the staging buffer for the current layout's size and copies states into it."""

    def __init__(self) -> None:
        self.buffer: StagingBuffer | None = None

    def buffer_for(self, plan: PartPlan, device: int | None = None) -> StagingBuffer:
        """The buffer for ``plan``'s data section (allocated when its size changes, the old one
        freed), pinned for copies from ``device`` (see :func:`tierpoint.pinning.copy_device`)."""
        buf = self.buffer
        if buf is None or buf.nbytes != plan.data_size:
            if buf is not None:
                self.buffer = None
                buf.close()
            buf = self.buffer = StagingBuffer(plan.data_size)
        buf.pin(device)
        return buf

    def warm(self, plan: PartPlan, device: int | None = None) -> StagingBuffer:
        """:meth:`buffer_for`, with every page of the buffer faulted in now (a fresh buffer's pages
        are otherwise allocated and zeroed by the first copy into them): ahead of the first save,
        so that it costs what a steady one does."""
        buf = self.buffer_for(plan)
        buf.prepare(device)
        return buf

    def stage(
        self,
        flat: FlatState,
        plan: PartPlan,
        after: Streams | None = None,
        image: torch.Tensor | None = None,
    ) -> StagingBuffer:
        """Copy every tensor of ``flat`` into the staging buffer for ``plan`` (blocking); device
        copies wait for the streams ``after`` (see :func:`tierpoint.snapshot_copy.copy_tensors`);
        ``image``: see :func:`copy_planned`."""
        return self._stage(flat, plan, False, after, image)[0]

    def stage_and_hash(
        self,
        flat: FlatState,
        plan: PartPlan,
        after: Streams | None = None,
        image: torch.Tensor | None = None,
    ) -> tuple[StagingBuffer, list[str] | None]:
        """:meth:`stage`, also returning each tensor's xxh3-64 checksum (plan order), computed on
        one thread as the copy goes (no second pass over the memory). None instead of checksums
        when some tensors come from a device: the worker hashes them (off this process's GIL)."""
        return self._stage(flat, plan, True, after, image)

    def _stage(
        self,
        flat: FlatState,
        plan: PartPlan,
        hash: bool,
        after: Streams | None,
        image: torch.Tensor | None,
    ) -> tuple[StagingBuffer, list[str] | None]:
        buf = self.buffer_for(plan, copy_device(flat.tensors))
        views = _views(buf, plan)
        return buf, copy_planned(flat, plan, buf.tensor, buf.pinned, hash, after, image, views)

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
