"""The local tier's jobs for the background worker: finish a part file from staged memory.

Call order: :meth:`~tierpoint.local.LocalCheckpointManager.save` builds an
:class:`~tierpoint.asyncsave.AsyncRequest` whose ``async_fn`` is :func:`write_staged_part` (the
snapshot went into a staging buffer) or :func:`seal_staged_part` (the snapshot filled the part file's
own pages in place); the worker imports this module by name and runs the function.

Invariants: each job runs in the worker, reads the staging memory the trainer filled (through
:func:`tierpoint.asyncsave.worker.resolve_buffer`) and leaves a complete part file under its final
name or none (:func:`tierpoint.fileformat.write_planned` / :func:`~tierpoint.fileformat.seal_planned`:
write, fsync, rename); it returns the bytes the part file holds. On a RAM tier, staged bytes that
still need their checksums and a recycled spare to go into are copied into the spare's own pages
through a shared mapping by the snapshot-copy engine's lanes, each tensor hashed as it is copied:
``write`` to a tmpfs file holds the file's lock, so one thread does all the copying (4.3 GB durable
in 1.03 s that way on an H100 host, 0.66 s with the lanes and a mapping made per save). The worker
keeps the spares mapped (:mod:`tierpoint.asyncsave.target_files`). Without a spare, ``write`` is
faster: a mapping's first touch of a new page clears it first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..asyncsave.target_files import mapped_file
from ..asyncsave.worker import BufferRef, resolve_buffer
from ..fileformat import PartPlan, prepare_planned, seal_planned, write_planned
from ..fileformat.tensor_bytes import range_checksums
from ..files import dirty_name, in_memory_filesystem, unlink_quietly
from ..snapshot_copy import LANES, copy_tensors
from ..staging import StagingBuffer


def write_staged_part(
    path: str,
    plan: dict[str, Any],
    buffer: StagingBuffer | BufferRef,
    recycle: str | None = None,
    checksums: list[str] | None = None,
) -> int:
    """Write a part file from a staging buffer laid out as ``plan`` (runs in the worker);
    ``checksums``: the tensors' checksums when the snapshot computed them already."""
    part_plan = PartPlan.from_json(plan)
    data = resolve_buffer(buffer)
    views = [data[begin:end] for begin, end in part_plan.offsets]
    if (
        checksums is None
        and recycle is not None
        and os.path.exists(recycle)
        and in_memory_filesystem(os.path.dirname(path) or ".")
    ):
        return _copy_in_place(path, part_plan, views, recycle)
    return write_planned(path, part_plan, views, recycle=recycle, checksums=checksums).nbytes


def _copy_in_place(
    path: str, plan: PartPlan, views: Sequence[memoryview], recycle: str | None
) -> int:
    """Copy and hash the staged views into the (prepared) dirty file's mapped pages, then seal it."""
    dirty = str(dirty_name(path))
    size = prepare_planned(dirty, plan, recycle)
    with _dirty_mapped(dirty, size) as whole:
        start = plan.data_start()
        targets = [whole[start + begin : start + end] for begin, end in plan.offsets]
        sums = copy_tensors([_bytes_of(v) for v in views], targets, pinned=False, hash=True)
        assert sums is not None  # CPU sources: always hashed
        del targets
    return seal_planned(path, plan, checksums=sums).nbytes


@contextlib.contextmanager
def _dirty_mapped(dirty: str, nbytes: int) -> Iterator[torch.Tensor]:
    """A part's dirty file mapped (:func:`~tierpoint.asyncsave.target_files.mapped_file`), removed
    when the block fails."""
    try:
        with mapped_file(dirty, nbytes) as whole:
            yield whole
    except BaseException:
        unlink_quietly(dirty)
        raise


def _bytes_of(view: memoryview) -> torch.Tensor:
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


def seal_staged_part(path: str, plan: dict[str, Any], checksums: list[str] | None = None) -> int:
    """Finish a part file the snapshot filled in place (its dirty file; runs in the worker): hash it
    unless ``checksums`` came with it (on the lanes, from the file's kept mapping), write the
    header, fsync, rename."""
    part_plan = PartPlan.from_json(plan)
    if checksums is None:
        with _dirty_mapped(str(dirty_name(path)), part_plan.file_size()) as whole:
            data = memoryview(whole.numpy())
            checksums = range_checksums(data, part_plan.data_start(), part_plan.offsets, LANES)
            data.release()
    return seal_planned(path, part_plan, checksums=checksums).nbytes
