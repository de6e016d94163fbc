"""The snapshot of an async DCP save: copy the state's tensors into staging memory, fast, and, when
the staging memory is the checkpoint file itself, give the filled file its name.

Call order (inside :meth:`~tierpoint.dcp.writer.Writer.snapshot`, in the trainer):
:func:`stages_in_place` decides at planning whether the save stages in place (a local RAM file
system); :func:`copy_pairs` matches each planned tensor with its place in the staging buffer;
:func:`fill` pins the buffer (once) and copies; for in-place staging :func:`name_in_place` appends
the non-tensor values and links the file into the step directory.

Invariants:
- Contiguous CPU tensors are copied as raw bytes in 8 MiB chunks by at most 4 threads (one pool per
  process, ``_copy_pool``, made on first use); CUDA tensors go through
  :func:`tierpoint.staging.copy_from_devices`; a tensor whose dtype or shape differs from the plan
  is refused before anything is copied.
- ``_links_work`` turns False, for the rest of the process, the first time a staged file cannot be
  named (the file system refuses ``linkat``): that save copies the file instead, and later saves
  stage in memory.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint.planner import SavePlan

from .. import storage
from ..errors import CheckpointingError
from ..files import in_memory_filesystem
from ..pinning import copy_device
from ..staging import StagingBuffer, copy_from_devices
from .file_plan import RankFiles

logger = logging.getLogger("tierpoint")


def copy_pairs(
    plan: SavePlan,
    files: RankFiles,
    buf: StagingBuffer,
    data_of: Callable[[int], torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each planned tensor (``data_of(item index)``) and the view of its place in ``buf``, checked
    against the plan."""
    sources, targets = [], []
    for f in files.files:
        for slot in f.tensors:
            item = plan.items[slot.item]
            begin = f.staging_base + slot.data_offset
            raw = buf.tensor[begin : begin + slot.template.nbytes]
            dtype = item.tensor_data.properties.dtype
            shape = tuple(item.tensor_data.chunk.sizes)
            src = data_of(slot.item)
            if tuple(src.shape) != shape or src.dtype != dtype:
                raise CheckpointingError(
                    f"{item.index.fqn}: planned {dtype} {list(shape)}, found {src.dtype} "
                    f"{list(src.shape)} (the state changed after planning)"
                )
            if raw.numel():
                sources.append(src)
                targets.append(raw.view(dtype).view(shape))
    return sources, targets


def fill(buf: StagingBuffer, sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """Copy ``sources`` into their ``targets`` in ``buf``, pinning ``buf`` first (once per buffer:
    a pool's buffers are pinned already) when the sources are on a device."""
    buf.pin(copy_device(sources))
    _copy(sources, targets, buf)


def stages_in_place(path: str) -> bool:
    """Whether an async save to ``path`` snapshots straight into its files (a local RAM file system,
    see :mod:`tierpoint.dcp.staging_pool`)."""
    return _links_work and storage.is_local(path) and in_memory_filesystem(storage.local_path(path))


_links_work = True  # False once naming a staged file failed (see StagingBuffer.link)


def name_in_place(
    buf: StagingBuffer, files: RankFiles, byte_records: list[list[bytes]], directory: str
) -> None:
    """Turn a filled file-backed buffer into the rank's one data file: the non-tensor values after
    the tensors, the exact size, then its name in ``directory``."""
    (spec,) = files.files
    records = b"".join(byte_records[0])
    target = os.path.join(directory, spec.name)
    at = spec.tensor_bytes
    view = memoryview(records)
    try:
        while view:
            n = os.pwrite(buf.fd, view, at)
            view, at = view[n:], at + n
        os.ftruncate(buf.fd, spec.tensor_bytes + len(records))
    except OSError as e:
        raise storage.failure("writing", target, e) from e
    try:
        buf.link(target)
    except OSError as e:
        global _links_work
        _links_work = False
        logger.info("cannot name staged files (%s): async saves stage in memory from now on", e)
        tensors = memoryview(buf.tensor.numpy())[: spec.tensor_bytes]
        storage.write_file(target, [tensors, records], fsync=False)  # the worker fsyncs it


_COPY_CHUNK = 8 << 20
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()


_COPY_LANES = max(1, min(4, os.cpu_count() or 1))


def _copy_threads() -> ThreadPoolExecutor:
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = ThreadPoolExecutor(_COPY_LANES, thread_name_prefix="tierpoint-snapshot")
        return _copy_pool


def _plain_bytes(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether ``src`` can be copied into ``dst`` as raw bytes (same dtype, contiguous CPU memory)."""
    return (
        src.device.type == "cpu"
        and src.layout == torch.strided
        and src.dtype == dst.dtype
        and src.is_contiguous()
        and not src.is_conj()
        and not src.is_neg()
    )


def _copy(sources: list[torch.Tensor], targets: list[torch.Tensor], buf: StagingBuffer) -> None:
    """Snapshot copy into staging memory.

    Contiguous CPU tensors are copied as raw bytes in chunks by a few threads (``memmove`` releases
    the GIL; no intra-op thread barriers, which cost a lot when training keeps the cores busy);
    anything else goes through ``Tensor.copy_``. CUDA sources go through
    :func:`tierpoint.staging.copy_from_devices` (side stream, into ``buf`` pinned when it was
    allocated).
    """
    if any(s.device.type == "cuda" for s in sources):
        copy_from_devices(sources, targets, buf.pinned)
        return
    with torch.no_grad():
        chunks: list[tuple[int, int, int]] = []
        for src, dst in zip(sources, targets):
            if not _plain_bytes(src, dst):
                dst.copy_(src)
                continue
            n = src.numel() * src.element_size()
            to, frm = dst.data_ptr(), src.data_ptr()
            chunks.extend(
                (to + o, frm + o, min(_COPY_CHUNK, n - o)) for o in range(0, n, _COPY_CHUNK)
            )
        if not chunks:
            return
        pool = _copy_threads()
        lanes = min(_COPY_LANES, len(chunks))
        done = [pool.submit(_memmove_all, chunks[k::lanes]) for k in range(lanes)]
        for f in done:
            f.result()


def _memmove_all(chunks: list[tuple[int, int, int]]) -> None:
    for to, frm, n in chunks:
        ctypes.memmove(to, frm, n)
