"""A DCP save split into plan / write / finalize, with planning cached across saves (NVRx names).

This module is NVRx's name for the split; it re-exports the public names of the modules that do
the work, so that code written for NVRx (and tierpoint's users) imports them from here or from
:mod:`tierpoint.dcp`:

- :mod:`tierpoint.dcp.metadata_cache`: :class:`CheckpointMetadataCache` and the process-wide cache;
- :mod:`tierpoint.dcp.planning`: :func:`save_state_dict_async_plan` (the vote on unchanged plans,
  the file token's agreement) and :func:`verify_global_md_reuse`;
- :mod:`tierpoint.dcp.commit`: :func:`save_state_dict_async_finalize` (what must travel to the
  coordinator, the commit of ``.metadata``).

Call order (every rank, same points)::

    writer = Writer(step_dir)
    writer, metadata, dist_wrapper = save_state_dict_async_plan(
        state_dict, writer, enable_cache=True, metadata_cache=cache)
    writer.write_now()                   # or: async_fn, preload_fn, args = writer.get_save_function_and_args()
    save_state_dict_async_finalize(writer, metadata, dist_wrapper)

A job resuming from a checkpoint can seed its cache with ``init_checkpoint_metadata_cache(
read_metadata(step_dir))`` and reuse the loaded plans from its first save (one all-reduce).
Whatever the outcome, finalize gives the writer's staging buffer back to its pool, so a caller who
builds its own ``AsyncRequest`` from ``get_save_function_and_args()`` keeps host memory flat too
(its abort function should call ``writer.release_staging()`` and ``writer.discard()``).

Invariants:
- All collectives run on the given process group, else on tierpoint's coordination group.
- A failure on any rank (set-up, planning, writing, commit) raises the same
  :class:`~tierpoint.errors.CheckpointingError` on every rank; ``.metadata`` is written only when
  every rank's data is durable, and a failed save's data files are removed.
- Messages of tierpoint's own collectives are JSON; the plans themselves travel the way torch DCP
  sends them (``_DistWrapper`` object collectives).
"""

from __future__ import annotations

from .commit import save_state_dict_async_finalize
from .metadata_cache import (
    CheckpointMetadataCache,
    default_metadata_cache,
    get_metadata_caching_status,
    init_checkpoint_metadata_cache,
)
from .planning import require_state_dict, save_state_dict_async_plan, verify_global_md_reuse

__all__ = [
    "CheckpointMetadataCache",
    "default_metadata_cache",
    "get_metadata_caching_status",
    "init_checkpoint_metadata_cache",
    "require_state_dict",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "verify_global_md_reuse",
]
