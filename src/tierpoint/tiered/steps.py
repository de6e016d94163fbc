"""The order of the steps a manager saves: each newer than the last one saved or restored, and at
the first save of a manager that did not restore, not older than a complete persistent step.

Call order: :class:`~tierpoint.tiered.TieredCheckpointManager` checks every step it is given with
:func:`checked_step`; at its first save, unless it restored (which saw the persistent steps, and
found the newer ones unloadable), it calls :func:`refuse_going_back` (collective), which lists
the persistent tier with :func:`listed_steps`, as the restore does.

Invariants: a run gone back to an older step with a new manager never saves beside the newer steps
it abandoned (retention would remove the run's own older steps first, keeping the abandoned
ones, and a restart would restore the abandoned newest one): it is refused on every rank alike,
as the local tier refuses an iteration older than a complete one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .. import dist as tpdist
from ..dcp.step_dirs import complete_steps, local_view
from ..errors import CheckpointingError, StorageUnavailableError

logger = logging.getLogger("tierpoint")


def checked_step(step: Any, last: int | None, saving: bool = False, final: bool = False) -> int:
    """``step`` as an int, refused unless a non-negative integer newer than ``last`` (the last
    step saved or restored; ``saving``: equal is refused too, unless ``final``)."""
    if isinstance(step, bool) or not isinstance(step, int) and not hasattr(step, "__index__"):
        raise CheckpointingError(f"step must be a non-negative integer, got {step!r}")
    step = int(step.__index__())
    if step < 0:
        raise CheckpointingError(f"step must be a non-negative integer, got {step}")
    if last is not None and (step < last or (step == last and saving and not final)):
        raise CheckpointingError(
            f"step {step} after step {last}: steps must increase (restore() or a new manager "
            "to go back)"
        )
    return step


def listed_steps(
    base: str, storage_options: Mapping[str, Any] | None, what: str
) -> tuple[list[int] | None, list[list] | None, str | None, bool]:
    """The persistent tier ``base`` as rank 0 lists it (one listing a job, one broadcast):
    its complete steps newest first, ``[step, marker ranks]`` of each committed step still
    marked unfinished, newest first, or (``None`` for both) why it could not be listed and whether
    the store did not answer (:class:`StorageUnavailableError`). Collective; ``what`` names it."""
    steps, unfinished, error, unavailable = None, None, None, False
    if tpdist.get_rank() == 0:
        try:
            view = local_view(base, storage_options)
            steps = complete_steps([view])
            unfinished = sorted(
                ([int(step), ranks] for step, committed, ranks in view if committed and ranks),
                reverse=True,
            )
        except Exception as e:  # noqa: BLE001 - shared with every rank below (none waits)
            error, unavailable = str(e), isinstance(e, StorageUnavailableError)
    steps, unfinished, error, unavailable = tpdist.broadcast_json(
        [steps, unfinished, error, unavailable], 0, what
    )
    return steps, unfinished, error, unavailable


def refuse_going_back(base: str, step: int, storage_options: Mapping[str, Any] | None) -> None:
    """Raise :class:`CheckpointingError` on every rank when ``base`` holds a complete step newer
    than ``step``. Collective (:func:`listed_steps`); a store that cannot be listed is a WARNING
    (the save itself says more)."""
    steps, _, error, _ = listed_steps(
        base, storage_options, f"listing {base} before the first save"
    )
    newest = steps[0] if steps else None
    if error is not None:
        logger.warning("cannot list %s to look for steps newer than %d: %s", base, step, error)
    elif newest is not None and newest > step:
        raise CheckpointingError(
            f"cannot save step {step}: the persistent tier {base} holds step {newest}, newer than "
            "it (a restart would restore that step, not this run's, and retention would remove "
            "this run's steps first). Call restore() to go on from it; to go back, move the newer "
            "steps away (or give this run another persistent_dir)"
        )
