"""Retention of the persistent tier: keep the newest ``keep`` complete steps, remove older ones.

Call order: the tiered manager calls :func:`retire_persistent_steps` on one rank (the coordinator)
right after a persistent save was committed on every rank, so the newest step is complete before
anything older goes; on a thread, with ``below`` the step just committed, while the manager's next
saves (newer steps) go on.

Invariants:
- A step is un-committed before it is emptied: its ``.metadata`` goes first, so a crash in between
  leaves a step that is not complete (skipped by discovery), never a half-removed one that looks
  complete.
- Only steps older than the newest complete one (and than ``below``) are touched; a step newer
  than it (a save in flight, or an interrupted one the next save into it will clean up) is left
  alone.
- A failure to remove is a WARNING, not a failed save: the new checkpoint is committed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .. import storage
from ..dcp.step_dirs import METADATA_NAME, complete_steps, local_view, step_path

logger = logging.getLogger("tierpoint")


def retire_persistent_steps(
    base: str,
    keep: int,
    storage_options: Mapping[str, Any] | None = None,
    below: int | None = None,
) -> list[int]:
    """Remove the complete steps under ``base`` beyond the ``keep`` newest, and incomplete steps
    older than the newest complete one; with ``below``, only steps older than it (the step just
    committed: the saves still to come are newer). Returns the steps removed."""
    view = local_view(base, storage_options)
    complete = complete_steps([view])
    if not complete:
        return []
    newest = complete[0] if below is None else min(complete[0], below)
    kept = set(complete[:keep])
    doomed = [step for step, _, _ in view if step < newest and step not in kept]
    removed = []
    for step in sorted(doomed):
        path = step_path(base, step)
        try:
            storage.remove(storage.join(path, METADATA_NAME), storage_options=storage_options)
            names = storage.listdir(path, storage_options)
            storage.remove_files(path, names, storage_options=storage_options)
            storage.remove_dir_if_empty(path, storage_options)
            removed.append(step)
        except Exception as e:  # noqa: BLE001 - the new checkpoint is committed; retried next time
            logger.warning("could not remove the old persistent checkpoint %s: %s", path, e)
    if removed:
        logger.info("removed persistent step(s) %s (keeping %d)", removed, keep)
    return removed
