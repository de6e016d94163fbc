"""The local tier's jobs for the background worker: finish a part file from staged memory.

Call order: :meth:`~tierpoint.local.LocalCheckpointManager.save` builds an
:class:`~tierpoint.asyncsave.AsyncRequest` whose ``async_fn`` is :func:`write_staged_part` (the
snapshot went into a staging buffer) or :func:`seal_staged_part` (the snapshot filled the part file's
own pages in place); the worker imports this module by name and runs the function.

Invariants: each job runs in the worker, reads the staging memory the trainer filled (through
:func:`tierpoint.asyncsave.worker.resolve_buffer`) and leaves a complete part file under its final
name or none (:func:`tierpoint.fileformat.write_planned` / :func:`~tierpoint.fileformat.seal_planned`:
write, fsync, rename); it returns the bytes the part file holds.
"""

from __future__ import annotations

from typing import Any

from ..asyncsave.worker import BufferRef, resolve_buffer
from ..fileformat import PartPlan, seal_planned, write_planned
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
    return write_planned(path, part_plan, views, recycle=recycle, checksums=checksums).nbytes


def seal_staged_part(path: str, plan: dict[str, Any], checksums: list[str] | None = None) -> int:
    """Finish a part file the snapshot filled in place (its dirty file; runs in the worker): hash it
    unless ``checksums`` came with it, write the header, fsync, rename."""
    return seal_planned(path, PartPlan.from_json(plan), checksums=checksums).nbytes
