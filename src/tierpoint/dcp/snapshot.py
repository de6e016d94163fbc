"""The snapshot of an async DCP save: copy the state's tensors into staging memory, fast, and, when
the staging memory is the checkpoint file itself, give the filled file its name; or, when the
tensors view a source file whose bytes stay as they are, copy nothing and say where their bytes lie.

Call order (inside :meth:`~tierpoint.dcp.writer.Writer.snapshot`, in the trainer):
:func:`stages_in_place` decides at planning whether the save stages in place (a local RAM file
system); with a :class:`~tierpoint.staging.SourceFile`, :func:`source_pieces` first lays out each
file as record bytes and ranges of the source (the worker reads the ranges: nothing is staged);
otherwise :func:`copy_pairs` matches each planned tensor with its place in the staging buffer
(views made once per buffer and layout: the pool makes them with the buffer);
:func:`fill` pins the buffer (once) and copies; for in-place staging :func:`name_in_place` appends
the non-tensor values and links the file into the step directory.

Invariants:
- Copies are :mod:`tierpoint.snapshot_copy`'s (the one engine both tiers use); a tensor whose
  dtype or shape differs from the plan is refused before anything is copied.
- :func:`source_pieces` reads no tensor's bytes (only addresses); it answers ``None``, and the
  snapshot copies as usual, unless every planned tensor's bytes lie in the source.
- ``_links_work`` turns False, for the rest of the process, the first time a staged file cannot be
  named (the file system refuses ``linkat``): that save copies the file instead, and later saves
  stage in memory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan

from .. import storage
from ..errors import CheckpointingError
from ..files import in_memory_filesystem
from ..pinning import copy_device
from ..snapshot_copy import Streams, copy_tensors
from ..staging import SourceFile, StagingBuffer
from .file_plan import RankFiles, TensorSlot, file_views

logger = logging.getLogger("tierpoint")


def copy_pairs(
    plan: SavePlan, files: RankFiles, buf: StagingBuffer, tensors: Sequence[torch.Tensor | None]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each planned tensor that has bytes (``tensors``: by plan item) and the view of its place in
    ``buf`` (made once per buffer and layout, see :meth:`~tierpoint.staging.StagingBuffer.
    views_for`), checked against the plan."""
    sources = []
    for f in files.files:
        for slot in f.tensors:
            src = _checked(plan, slot, tensors[slot.item])
            if slot.template.nbytes:
                sources.append(src)
    return sources, buf.views_for(files.key, files.views)


Pieces = list[list[Any]]
"""Per file, its tensor section in order: ``bytes`` (record heads, tails, padding) and
``(offset, length)`` ranges of a :class:`~tierpoint.staging.SourceFile` (a tensor's bytes)."""


def source_pieces(
    plan: SavePlan, files: RankFiles, source: SourceFile, tensors: Sequence[torch.Tensor | None]
) -> Pieces | None:
    """Each file's tensor section as pieces, every planned tensor's bytes a range of ``source``
    (checked against the plan); ``None`` when some tensor's bytes are not in ``source``."""
    out = []
    for f in files.files:
        ranges = []
        for slot in f.tensors:
            src = _checked(plan, slot, tensors[slot.item])
            at = source.offset_of(src) if slot.template.nbytes else 0
            if at is None:
                fqn = plan.items[slot.item].index.fqn
                logger.debug("%s: its bytes are not in the source file: the snapshot copies", fqn)
                return None
            ranges.append((at, slot.template.nbytes))
        pieces: list[Any] = []
        for piece in file_views(f, ranges):  # the ranges stand for the tensors' views
            if isinstance(piece, tuple) or not pieces or isinstance(pieces[-1], tuple):
                pieces.append(piece if isinstance(piece, tuple) else bytes(piece))
            else:
                pieces[-1] += piece
        out.append(pieces)
    return out


def _checked(plan: SavePlan, slot: TensorSlot, src: torch.Tensor | None) -> torch.Tensor:
    """The tensor of ``slot``, refused if its dtype or shape differs from the plan."""
    if src is None or src.dtype is not slot.dtype or src.shape != slot.shape:
        found = "nothing" if src is None else f"{src.dtype} {list(src.shape)}"
        raise CheckpointingError(
            f"{plan.items[slot.item].index.fqn}: planned {slot.dtype} {list(slot.shape)}, found "
            f"{found} (the state changed after planning)"
        )
    return src


def fill(
    buf: StagingBuffer,
    sources: list[torch.Tensor],
    targets: list[torch.Tensor],
    after: Streams | None = None,
) -> None:
    """Copy ``sources`` into their ``targets`` in ``buf``, pinning ``buf`` first (once per buffer:
    a pool's buffers are pinned already) when the sources are on a device; device copies wait for
    the streams ``after`` (:func:`tierpoint.snapshot_copy.training_streams`)."""
    buf.pin(copy_device(sources))
    copy_tensors(sources, targets, buf.pinned, after=after)


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
