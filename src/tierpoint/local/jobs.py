"""The local tier's jobs for the background worker: finish a part file from staged memory.

Call order: :meth:`~tierpoint.local.LocalCheckpointManager.save` builds an
:class:`~tierpoint.asyncsave.AsyncRequest` whose ``async_fn`` is :func:`write_staged_part` (the
snapshot went into a staging buffer) or :func:`seal_staged_part` (the snapshot filled the part file's
own pages in place); the worker imports this module by name and runs the function.

Invariants: each job runs in the worker, reads the staging memory the trainer filled (through
:func:`tierpoint.asyncsave.worker.resolve_buffer`) and leaves a complete part file under its final
name or none (:func:`tierpoint.fileformat.write_planned` / :func:`~tierpoint.fileformat.seal_planned`:
write, fsync, rename); it returns the bytes the part file holds. A snapshot staged in memory is
written with ``write`` (a disk tier, or no recycling); on a RAM tier with recycling the snapshot
fills the part file's own pages and the job hashes them (on the copy lanes, through a mapping the
worker keeps, :mod:`tierpoint.asyncsave.target_files`) and seals the file.
"""

from __future__ import annotations

from ..asyncsave.target_files import mapped_file
from ..asyncsave.worker import BufferRef, resolve_buffer
from ..fileformat import PartPlan, seal_planned, write_planned
from ..fileformat.tensor_bytes import range_checksums
from ..files import dirty_name, unlink_quietly
from ..snapshot_copy import LANES
from ..staging import StagingBuffer


def write_staged_part(
    path: str,
    plan: PartPlan,
    buffer: StagingBuffer | BufferRef,
    recycle: str | None = None,
    checksums: list[str] | None = None,
) -> int:
    """Write a part file from a staging buffer laid out as ``plan`` (runs in the worker);
    ``checksums``: the tensors' checksums when the snapshot computed them already."""
    data = resolve_buffer(buffer)
    views = [data[begin:end] for begin, end in plan.offsets]
    return write_planned(path, plan, views, recycle=recycle, checksums=checksums).nbytes


def seal_staged_part(path: str, plan: PartPlan, checksums: list[str] | None = None) -> int:
    """Finish a part file the snapshot filled in place (its dirty file; runs in the worker): hash it
    unless ``checksums`` came with it (on the lanes, from the file's kept mapping), write the
    header, fsync, rename."""
    if checksums is None:
        dirty = str(dirty_name(path))
        try:
            with mapped_file(dirty, plan.file_size()) as whole:
                with memoryview(whole.numpy()) as data:
                    start, offsets = plan.data_start(), plan.offsets
                    checksums = range_checksums(data, start, offsets, LANES)
        except BaseException:
            unlink_quietly(dirty)
            raise
    return seal_planned(path, plan, checksums=checksums).nbytes
