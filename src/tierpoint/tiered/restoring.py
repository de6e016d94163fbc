"""The restore path across tiers: the newest checkpoint complete anywhere, loaded into a state.

Call order: :meth:`TieredCheckpointManager.restore` takes the state apart (``tree``) and calls
:func:`restore_newest`; it lists the persistent tier once (rank 0, broadcast), tries the local tier
(parts fetched from peer replicas where a node lost its own) if its newest complete step is at least
as new as the newest persistent one, then the persistent steps newest first (the local tier
before any persistent step older than it). On no restore the caller gives fresh optimizers their
empty state back (:func:`reset`).

Invariants: every rank gets the same answer (each decision is agreed); a step that cannot be loaded
on every rank (missing everywhere, failing verification, a persistent step directory holding the
checkpoint saved as another step, a local step saved in another parallel layout: the local tier
does not reshard, so it is set aside and the next save removes it) is skipped with its reason
(logged and kept in the record's ``skipped``, as are, once a step was restored, the newer local
steps a killed save left incomplete and the newer persistent steps with a ``.metadata`` but
unfinished markers);
a local step older than the newest persistent one is tried once every newer persistent step failed
(before any older one: the newest step that loads is restored, whichever tier holds it);
when checkpoints exist (or a tier cannot be listed) but none loads, :class:`CheckpointingError`
says why on every rank, never "nothing to restore" (the run would start over and save over them);
a different state structure raises
:class:`StateMismatchError` on every rank before anything is copied, as do a coordination
timeout and a store that does not answer while the persistent steps are listed or one is read,
rather than being skipped; a member's ``load_state_dict`` that raises on one rank raises on every
rank (the state is then partly restored).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from .. import dcp, storage
from .. import dist as tpdist
from ..dcp.step_dirs import UNKNOWN_RANK, step_dir_of, step_path
from ..errors import (
    CheckpointingError,
    CoordinationTimeoutError,
    StateMismatchError,
    StorageUnavailableError,
)
from ..local import LocalCheckpointManager
from . import param_groups
from . import state as st
from .events import RestoreRecord
from .numpy_values import sized_as_saved
from .runs import check_run
from .saved_lists import lists_as_saved
from .steps import listed_steps
from .tree_paths import holds

logger = logging.getLogger("tierpoint")

_NOT_SKIPPED = (StateMismatchError, CoordinationTimeoutError, StorageUnavailableError)
"""Raised on every rank rather than skipped for an older step: the state is wrong, the ranks did not
answer, or the store did not (the step may be intact: restoring an older one would lose it)."""


def restore_newest(
    state: dict[str, Any],
    tree: dict[str, Any],
    local: LocalCheckpointManager | None,
    persistent_dir: str | None,
    storage_options: dict[str, Any],
    start: float,
) -> tuple[RestoreRecord, int]:
    """Load the newest checkpoint complete in either tier into ``state`` (``tree`` its template);
    the record's ``step`` is ``None`` when there is none. Collective. Also returns the newest
    complete persistent step (-1: none), the same on every rank."""
    skipped: list[str] = []
    persistent, unfinished = _persistent_candidates(persistent_dir, storage_options, skipped)
    newest_persistent = persistent[0] if persistent else -1

    def restored(record: RestoreRecord) -> tuple[RestoreRecord, int]:
        return _with_newer_unusable(record, local, unfinished), newest_persistent

    local_latest = -1 if local is None else local.find_latest()
    if local is not None:
        _note_other_world_parts(local, max(local_latest, newest_persistent), skipped)
        if local_latest == -1:  # (the same on every rank)
            skipped += [f"local tier: {reason}" for reason in local.unusable_parts()]
    # The persistent steps newest first, the local tier's newest loadable step among them where it
    # is at least as new as the next one (-1: every persistent step failed). The local load falls
    # back to older local steps by itself: one load, made once its newest step is a candidate.
    loaded, tried, noted = None, local is None or local_latest == -1, False
    for step in [*persistent, -1]:
        if not tried and local_latest >= step:
            tried, loaded = True, _load_local(local, skipped)
        if loaded is not None and loaded[1].iteration >= step:
            latest = loaded[1].iteration if noted else local_latest
            record = _apply_local(
                loaded, local, tree, state, latest, skipped, start, persistent_dir
            )
            if record is not None:
                return restored(record)
            loaded = None  # another parallel layout: the persistent tier reshards
        elif loaded is not None and not noted:  # a persistent step newer than it is tried first
            noted = True
            skipped += loaded[1].skipped or [
                f"local steps newer than {loaded[1].iteration}: cannot be loaded on every rank"
            ]
        if step == -1:
            break
        assert persistent_dir is not None
        record = _restore_persistent(
            persistent_dir, storage_options, state, tree, step, skipped, start
        )
        if record is not None:
            return restored(record)
    if skipped and all(r.startswith(_UNLISTED) for r in skipped):
        raise CheckpointingError(
            f"{skipped[0]}: whether checkpoints exist there is unknown (starting over could save "
            "over them). Give access to the store, or correct persistent_dir"
        )
    if skipped:
        raise CheckpointingError(
            "checkpoints exist but none could be restored (starting over would save over them): "
            + "; ".join(skipped)
            + ". Mend or move them away to start from scratch"
        )
    return restored(RestoreRecord(None, None, time.perf_counter() - start, 0, skipped))


def owed_copy(record: RestoreRecord, newest_persistent: int, every: int) -> int | None:
    """The step the persistent tier's schedule (``every``) had due last by the restored step, when
    the tier lacks it: its copy, made from the local part after the local save, died with the job.
    The next save makes up for it (``None``: nothing is owed; 0: none is there, step 0 counting)."""
    if record.step is None or record.tier == "persistent" or not every:
        return None
    due = record.step // every * every
    return due if newest_persistent < due else None


def _with_newer_unusable(
    record: RestoreRecord, local: LocalCheckpointManager | None, unfinished: list[list]
) -> RestoreRecord:
    """``record`` naming first the steps newer than the one restored that were not candidates:
    persistent steps with a ``.metadata`` but unfinished markers, and (once a step was restored: an
    interrupted first save starts over) local steps a killed save left incomplete."""
    step = -1 if record.step is None else record.step
    newer = _unfinished_reasons([s for s in unfinished if s[0] > step])
    if local is not None and record.step is not None:
        newer += [why for i, why in local.incomplete_parts() if i > step]
    record.skipped[:0] = newer
    return record


_UNLISTED = "persistent tier: cannot list"


def _persistent_candidates(
    persistent_dir: str | None, storage_options: dict[str, Any], skipped: list[str]
) -> tuple[list[int], list[list]]:
    """The complete persistent steps, newest first, as rank 0 lists them (one listing per job),
    and ``[step, marker ranks]`` of each step that has a ``.metadata`` but unfinished markers (a
    save killed between its commit and its clean-up: not complete, so not loaded, but it looks
    like a checkpoint and the record must say why when it is newer than the step restored, which
    may be older than the newest complete one: that one can fail to load). A store that does not
    answer raises :class:`StorageUnavailableError` on every rank: the local tier's newest step may
    be older than the persistent steps it cannot list, and restoring it would rewind the run."""
    if persistent_dir is None:
        return [], []
    what = f"listing persistent checkpoints under {persistent_dir}"
    steps, unfinished, error, unavailable = listed_steps(persistent_dir, storage_options, what)
    if unavailable:
        raise StorageUnavailableError(
            f"restore: cannot list the persistent tier {persistent_dir}: {error} (restoring "
            "another tier's step instead could rewind past the steps it holds)"
        )
    if error is not None:
        skipped.append(f"{_UNLISTED} {persistent_dir}: {error}")
        logger.warning("restore: cannot list the persistent tier: %s", error)
        return [], []
    return steps, unfinished


def _unfinished_reasons(unfinished: list[list]) -> list[str]:
    """Why each committed but still marked persistent step (newer than the one restored) was not
    loaded; each logged as a WARNING."""
    reasons = []
    for step, ranks in unfinished:
        named = ", ".join("?" if r == UNKNOWN_RANK else str(r) for r in ranks)
        reasons.append(
            f"persistent step {step}: not complete: it has a .metadata but the unfinished "
            f"markers of rank(s) {named} (its save was interrupted between its commit and its "
            "clean-up; the next save of that step saves it again)"
        )
        logger.warning("restore: skipping %s", reasons[-1])
    return reasons


def _note_other_world_parts(local: LocalCheckpointManager, newest: int, skipped: list[str]) -> None:
    """Local steps newer than ``newest`` (the newest step either tier offers this job) saved with
    another world size: the local tier does not reshard, so they are skipped, and said so; with
    nothing else to restore, the restore then refuses to start over (whose first save would remove
    them) rather than answer "nothing to restore"."""
    newer = [(i, w) for i, w in local.other_world_parts() if i > newest]
    if newer:
        step, world = newer[0]
        skipped.append(
            f"local step {step}: saved with world size {world}, this job has "
            f"{local.world_size} ranks (the local tier does not reshard; restart with "
            f"{world} ranks, or restore from a persistent checkpoint)"
        )


def _load_local(local: LocalCheckpointManager, skipped: list[str]) -> tuple[Any, Any] | None:
    """The local tier's newest checkpoint loadable on every rank and its load record, or None."""
    try:
        ta, _ = local.load()
    except CoordinationTimeoutError:
        raise  # a rank stopped or too slow: not the checkpoint's fault (later collectives wait too)
    except CheckpointingError as e:
        skipped.append(f"local tier: {e}")
        logger.warning("restore: no local checkpoint could be loaded: %s", e)
        return None
    assert local.last_load is not None
    return ta, local.last_load


def _apply_local(
    loaded: tuple[Any, Any],
    local: LocalCheckpointManager,
    tree: dict[str, Any],
    state: dict[str, Any],
    latest: int,
    skipped: list[str],
    start: float,
    persistent_dir: str | None,
) -> RestoreRecord | None:
    """Check a loaded local checkpoint against the state (collective), then put it in place.
    ``None`` (on every rank) when it was saved in another parallel layout (the local tier stores
    each rank's shards as they were): it is set aside, and the reason recorded. Raised on every
    rank: another run's step (:mod:`.runs`), another state structure."""
    ta, record = loaded
    checkpoint = ta.state_dict
    live = st.local_form(tree)
    what = f"checking the state against local checkpoint step {record.iteration}"
    with tpdist.agree(what) as layout:
        check_run(checkpoint, persistent_dir, record.iteration, local.local_ckpt_dir.parent)
        resharded = st.shardings_differ(live, checkpoint)
        if resharded and not st.check_loaded(_shapeless(live), _shapeless(checkpoint)):
            layout.key = "another layout"  # shapes differ too: the shards are another layout's
        else:  # (other keys or parameter groups: the state differs, not only its layout)
            problems = st.check_loaded(live, checkpoint)
            if resharded:
                problems.append("DTensor shardings differ from the checkpoint's")
            if problems:
                raise StateMismatchError(_mismatch(record.iteration, problems))
    if layout.key or not layout.same:  # (some rank's layout differs: alike on every rank)
        local.set_aside(record.iteration)
        skipped.append(
            f"local step {record.iteration}: saved in another parallel layout (DTensor meshes or "
            "placements differ from the state's; the local tier does not reshard)"
        )
        logger.warning("restore: skipping %s", skipped[-1])
        return None
    checkpoint.pop(st.SHARDING_KEY, None)  # checked above; not part of the state
    st.copy_into(tree, checkpoint)
    _apply(state, tree, f"local checkpoint step {record.iteration}")
    tier = "peers" if record.from_peers else "local"
    if record.iteration != latest:  # (find_latest again would wait for the replicas)
        skipped += record.skipped or [f"newer local steps than {record.iteration}: not loadable"]
    return RestoreRecord(
        record.iteration, tier, time.perf_counter() - start, record.nbytes, skipped
    )


def _apply(state: dict[str, Any], tree: dict[str, Any], what: str) -> None:
    """:func:`st.apply`, agreed: a member's ``load_state_dict`` that raises on one rank raises on
    every rank (its peers would return the step and wait in training's next collective)."""
    with tpdist.agree(f"putting {what} into the state"):
        st.apply(state, tree)


def _shapeless(tree: Any) -> Any:
    """``tree`` with an empty tensor for each tensor: what :func:`st.check_loaded` then finds
    between two of them is a difference of structure (keys, parameter groups), not of shards."""
    if isinstance(tree, torch.Tensor):
        return torch.empty(0)
    if isinstance(tree, dict):
        return {k: _shapeless(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_shapeless(v) for v in tree]
    return tree


def _restore_persistent(
    persistent_dir: str,
    storage_options: dict[str, Any],
    state: dict[str, Any],
    tree: dict[str, Any],
    step: int,
    skipped: list[str],
    start: float,
) -> RestoreRecord | None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    path = step_path(persistent_dir, step)
    options = storage_options or None
    rank = tpdist.get_rank()
    source = rank
    try:
        with tpdist.agree(f"reading the metadata of {path}"):
            metadata = dcp.read_metadata(path, storage_options=options)
    except _NOT_SKIPPED:
        raise
    except CheckpointingError as e:
        return _skip(skipped, step, e)
    saved_as = _saved_step(metadata)
    if saved_as not in (None, step):  # the same bytes on every rank: the same decision
        why = f"holds the checkpoint saved as step {saved_as} (copied or renamed): not step {step}"
        return _skip(skipped, step, CheckpointingError(why))
    stored = metadata.state_dict_metadata
    if not holds(stored, f"{st.RANK_LOCAL_KEY}.{rank}"):
        source = 0  # saved with fewer ranks: rank 0's values, as after any resharding
    from_arrays: list[torch.Tensor] = []
    ptree = lists_as_saved(st.persistent_form(tree, source, from_arrays, stored), stored)
    groups = param_groups.sizes_of(ptree)
    try:  # numpy values are replaced, not copied into: they take the saved shapes and dtypes
        with tpdist.agree(f"allocating the numpy values of persistent step {step}"):
            ptree = sized_as_saved(ptree, from_arrays, metadata)
            ptree = param_groups.without_saved_state(ptree, groups, metadata)
        stored_groups = param_groups.stored_sizes(groups, metadata, path, options)
    except _NOT_SKIPPED:
        raise
    except CheckpointingError as e:
        return _skip(skipped, step, e)
    with tpdist.agree(f"checking the state against persistent step {step}"):
        flat, _ = flatten_state_dict(ptree)
        problems = check_against_metadata(flat, metadata)
        problems += param_groups.problems(groups, stored_groups)
        if problems:
            raise StateMismatchError(_mismatch(step, problems))
    try:
        dcp.load(ptree, path, storage_options=options)
    except _NOT_SKIPPED:
        raise
    except CheckpointingError as e:
        return _skip(skipped, step, e)
    st.from_persistent_form(tree, ptree)
    _apply(state, tree, f"persistent step {step}")
    return RestoreRecord(step, "persistent", time.perf_counter() - start, st.nbytes(ptree), skipped)


def check_against_metadata(flat: Mapping[str, Any], metadata: Any) -> list[str]:
    """Every difference between a flattened state (torch DCP's fully qualified names) and the
    ``state_dict_metadata`` of a DCP checkpoint."""
    stored = metadata.state_dict_metadata
    problems = []
    missing = sorted(k for k in flat if k not in stored)
    extra = sorted(k for k in stored if k not in flat and not k.startswith(st.RANK_LOCAL_KEY))
    if missing:
        problems.append(f"not in the checkpoint: {st.listed(missing)}")
    if extra:
        problems.append(f"only in the checkpoint: {st.listed(extra)}")
    for key, value in flat.items():
        md = stored.get(key)
        if md is None:
            continue
        size = getattr(md, "size", None)
        if not isinstance(value, torch.Tensor):
            if size is not None:  # torch DCP would fail the load: refused before it starts
                problems.append(
                    f"{key}: {type(value).__name__} in the state, a tensor in the checkpoint"
                )
            continue
        dtype = getattr(getattr(md, "properties", None), "dtype", None)
        if size is None:
            problems.append(f"{key}: a tensor in the state, a value in the checkpoint")
        elif tuple(size) != tuple(value.shape) or dtype != value.dtype:
            problems.append(
                f"{key}: {value.dtype} {tuple(value.shape)} in the state, "
                f"{dtype} {tuple(size)} in the checkpoint"
            )
    return problems


def _saved_step(metadata: Any) -> int | None:
    """The step of the directory a checkpoint was saved into, as its ``.metadata`` records it
    (``None``: not a step directory, or not recorded). The base may differ (a run moved)."""
    saved_into = getattr(getattr(metadata, "storage_meta", None), "checkpoint_id", None)
    if saved_into is None:
        return None
    return step_dir_of(storage.basename(str(saved_into)))


def _skip(skipped: list[str], step: int, error: BaseException) -> None:
    skipped.append(f"persistent step {step}: {error}")
    logger.warning("restore: skipping persistent step %d: %s", step, error)


def _mismatch(step: int, problems: list[str]) -> str:
    return (
        f"the state does not match the checkpoint of step {step} (nothing was loaded): "
        + "; ".join(problems)
    )


def reset(optimizers: list[torch.optim.Optimizer]) -> None:
    """Give optimizers initialised for a restore that did not happen their empty state back."""
    for optimizer in optimizers:
        optimizer.state.clear()
