"""Which run a local checkpoint belongs to, so that a new run never resumes another run's state.

The local tier tells jobs apart by ``session_id`` alone. A new run started on the nodes of an
earlier one with that run's session (its own ``persistent_dir``, the same local root) would find the
earlier run's local steps and, its own persistent tier being empty, restore them. So the tiered
manager records its run, the persistent tier's location, in each local part, and a restore refuses
a local step recorded for another location, on every rank, naming both.

Call order: :func:`tagged` on each local save (the part's state gets :data:`RUN_KEY`);
:func:`check_run` on restore, before anything is copied (it takes the key out again).

Invariants: a manager without a persistent tier, and a part saved before runs were recorded, carry
no run and match any; locations are compared normalized (a URL without a trailing slash; a local
path, ``file://`` removed, made absolute, and where the spellings still differ, with its links
resolved: a restart that reaches the directory through a link is the same run).
"""

from __future__ import annotations

import os
from typing import Any

from .. import storage
from ..errors import CheckpointingError

RUN_KEY = "__run__"
"""Where a local part records the persistent tier of the run that saved it."""


def run_of(persistent_dir: str | None) -> str | None:
    """The run a manager with this persistent tier saves as (``None``: no persistent tier)."""
    if persistent_dir is None:
        return None
    if not storage.is_local(persistent_dir):
        return persistent_dir.rstrip("/")
    return os.path.abspath(storage.local_path(persistent_dir))


def tagged(local_tree: dict[str, Any], persistent_dir: str | None) -> dict[str, Any]:
    """``local_tree`` (a local part's state, new) with the run that saves it recorded."""
    run = run_of(persistent_dir)
    if run is not None:
        local_tree[RUN_KEY] = run
    return local_tree


def check_run(
    checkpoint: dict[str, Any], persistent_dir: str | None, step: int, session_dir: object
) -> None:
    """Take the run out of a loaded local part's state; raise if another run saved it."""
    saved, run = checkpoint.pop(RUN_KEY, None), run_of(persistent_dir)
    if saved is None or run is None or _same_run(saved, run):
        return
    raise CheckpointingError(
        f"local step {step} in {session_dir} was saved by another run (persistent_dir {saved!r}, "
        f"not {run!r}): restoring it would resume that run's state. A new run on these nodes needs "
        "its own session_id; to resume that run, give its persistent_dir; to drop its local "
        f"steps, remove {session_dir}"
    )


def _same_run(saved: object, run: str) -> bool:
    """Whether the run recorded in a part (``saved``) is ``run``: the same text, or local paths to
    one directory (links resolved now; a ``file://`` URL recorded as it was given)."""
    if saved == run:
        return True
    if not isinstance(saved, str) or not (storage.is_local(saved) and storage.is_local(run)):
        return False
    here, there = (os.path.realpath(storage.local_path(p)) for p in (saved, run))
    return here == there
