"""Warming the persistent tier up: the staging memory of the first async save, prepared ahead of it.

Call order (every rank, not collective)::

    tierpoint.dcp.warm_up(state_dict, step_path(base, first_step))   # after the first optimizer step
    ...                                                               # train
    tierpoint.dcp.async_save(state_dict, step_path(base, first_step))  # finds its buffer ready

:func:`warm_up` reads the state's tensor sizes and devices, makes the ``torch.save`` record bytes of
each tensor's dtype and shape (cached: the first save's files are laid out from them), and asks the
staging pool for one buffer of an upper bound of the save's tensor sections
(:meth:`StagingPool.warm_up`: allocated, its pages faulted in, pinned for CUDA tensors, in a
background thread); the first save without a buffer of its layout takes it. Planning is not done
here (it is collective, and the layout a save stages is known only after it), so the bound is taken
from the state alone.

Invariants: nothing is written to the checkpoint directory; a warm-up that fails is a WARNING and
the first save allocates as it would have; host memory: at most one warmed buffer per pool.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .. import storage
from ..dtensors import is_dtensor, local_shard
from ..pinning import copy_device
from ..tree import tensors_in
from .file_plan import staging_bound
from .saving import stateful_to_state_dict
from .snapshot import stages_in_place
from .staging_pool import StagingPool
from .step_dirs import checkpoint_id_or_path
from .torch_save_bytes import record_template
from .writer import DEFAULT_POOL

logger = logging.getLogger("tierpoint")


def warm_up(
    state_dict: dict[str, Any],
    path_or_url: str | os.PathLike | None = None,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    staging_pool: StagingPool | None = None,
) -> None:
    """Prepare the staging memory of the first :func:`~tierpoint.dcp.async_save` of
    ``state_dict`` to ``path_or_url`` (a step directory, or the directory the steps go in) in a
    background thread, so that the first save costs what a steady one does. Not collective; call it
    once the state has the layout it is saved with (after the first optimizer step), steps before
    the first save. ``staging_pool``: the pool the saves use (default: the module's)."""
    path = checkpoint_id_or_path(path_or_url, checkpoint_id, "warm_up")
    tensors = [
        local_shard(t) if is_dtensor(t) else t
        for t in tensors_in(stateful_to_state_dict(state_dict))
    ]
    device = copy_device(tensors)
    in_place_dir = None
    if device is None and storage.is_local(path):  # CUDA states stage in memory (pinned, reused)
        existing = _existing_dir(storage.local_path(path))
        if existing is not None and stages_in_place(existing):
            in_place_dir = existing
    try:  # the first save's file layout then finds each record's bytes made
        for t in tensors:
            record_template(t.dtype, tuple(t.shape))
    except Exception as e:  # noqa: BLE001 - a warm-up never fails the job
        logger.warning("warm_up: the tensors' record bytes are left to the first save (%s)", e)
    pool = staging_pool if staging_pool is not None else DEFAULT_POOL
    pool.warm_up(
        staging_bound([t.numel() * t.element_size() for t in tensors]), device, in_place_dir
    )


def _existing_dir(path: str) -> str | None:
    """``path``, or its nearest ancestor that exists (a step directory is made by its save)."""
    for candidate in (Path(path), *Path(path).parents):
        if candidate.is_dir():
            return str(candidate)
    return None
