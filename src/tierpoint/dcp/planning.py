"""Planning a DCP save: the plan step of plan / write / finalize, cached across saves.

Call order: :func:`save_state_dict_async_plan` on every rank (then the writer writes, then
:func:`tierpoint.dcp.commit.save_state_dict_async_finalize`). Inside: set-up and the local plan
(torch's ``DefaultSavePlanner`` or the planner given); with a
:class:`~tierpoint.dcp.metadata_cache.CheckpointMetadataCache` holding a plan, one all-reduce of a
few integers (the vote) tells every rank whether all local plans are unchanged, and the cached
central plan and (on the coordinator) metadata are reused: no gather, no scatter. Else torch's
``reduce_scatter`` plans again (a changed layout is never missed). The same all-reduce agrees the
save's file token (:func:`_agree_token`) and whether some rank's directory holds an earlier save,
whose files every rank then removes before any rank writes.

Plans loaded with a checkpoint (``all_local_plans``, NVRx's attribute of the global metadata) let a
resumed job skip planning at its first save: :func:`verify_global_md_reuse` is NVRx's check.

With the cache and torch's default planner, the local plan itself is reused when what torch builds
it from is unchanged (:func:`_local_layout`): each value's key, and for a plain tensor its dtype,
shape, layout, device, ``requires_grad`` and pinning. Made afresh, a state of ~1000 tensors costs
a save tens of milliseconds and ~14,000 objects (a write item and its metadata per tensor), which
bring on full collections of the training process's heap. DTensors, sharded tensors and objects
that make their own write items are planned afresh every time.

Invariants:
- All collectives run on the given process group, else on tierpoint's coordination group.
- A failure on any rank raises the same :class:`~tierpoint.errors.CheckpointingError` on every
  rank, and this rank's files and marker are removed (:func:`cleanup_after_failure`).
- Every rank names its files with the same token once planning returned.
- A rank's requests to the store between two collectives (set-up, removing an earlier save's
  files, clean-up after a failure) end within :func:`store_budget`: a store that stops answering
  fails the save on every rank, never the job's coordination.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.utils import _DistWrapper

from .. import dist as tpdist
from ..errors import CheckpointingError, error_text, failed_on_ranks
from ..storage.retries import deadline
from ..tree import PLAIN_TENSOR_TYPES
from .metadata_cache import CheckpointMetadataCache, default_metadata_cache
from .writer import Writer

logger = logging.getLogger("tierpoint")

_REUSE, _CHANGED, _FAILED = 1, 0, -1


def require_state_dict(state_dict: Any) -> None:
    """A DCP state dict is a dict of tensors and values; anything else is a clear error."""
    if not isinstance(state_dict, dict):
        raise CheckpointingError(
            f"state_dict must be a dict (e.g. {{'model': model.state_dict()}}), got "
            f"{type(state_dict).__name__}"
        )


def save_state_dict_async_plan(
    state_dict: dict[str, Any],
    storage_writer: Writer,
    process_group: Any = None,
    coordinator_rank: int = 0,
    planner: SavePlanner | None = None,
    enable_cache: bool = False,
    metadata_cache: CheckpointMetadataCache | None = None,
) -> tuple[Writer, Metadata | None, _DistWrapper]:
    """Plan a save; returns ``(storage_writer, global_metadata or None, dist_wrapper)`` for
    :func:`save_state_dict_async_finalize` (``global_metadata`` only on the coordinator)."""
    if not isinstance(storage_writer, Writer):
        raise TypeError(
            "save_state_dict_async_plan needs a tierpoint.dcp.Writer as storage_writer (it plans, "
            "stages and commits through it), got "
            f"{type(storage_writer).__module__}.{type(storage_writer).__qualname__}: use "
            "Writer(checkpoint_id) in place of torch's FileSystemWriter or NVRx's "
            "FileSystemWriterAsync"
        )
    # A writer whose async save is not finalized yet: refused on this rank before anything is
    # touched or agreed (reusing a writer that way is the same mistake on every rank).
    storage_writer.refuse_if_in_flight()
    use_dist = tpdist.is_distributed()
    if not use_dist:
        tpdist.refuse_uninitialised_launch()
    group = (process_group or tpdist.coordination_group()) if use_dist else None
    size = torch.distributed.get_world_size(group) if use_dist else 1
    if not 0 <= coordinator_rank < size:  # (its type is checked by the save's options)
        raise CheckpointingError(
            f"coordinator_rank must be a rank of the group (0 to {size - 1}), got {coordinator_rank!r}"
        )
    dist_wrapper = _DistWrapper(group, use_dist, coordinator_rank)
    default_planner = planner is None
    planner = planner if planner is not None else DefaultSavePlanner()
    cache = (metadata_cache or default_metadata_cache()) if enable_cache else None
    storage_writer.metadata_cache = cache
    rank, is_coordinator = dist_wrapper.get_rank(), dist_wrapper.is_coordinator

    local_plan: SavePlan | None = None
    layout: tuple | None = None  # what local_plan was made from, when it can be reused
    reusable = (  # torch's planner and this module's writer: nothing else shapes the local plan
        cache is not None
        and default_planner
        and type(storage_writer).prepare_local_plan is Writer.prepare_local_plan
    )
    error: BaseException | None = None
    try:
        require_state_dict(state_dict)
        planner.set_up_planner(
            state_dict=state_dict,
            storage_meta=storage_writer.storage_meta(),
            is_coordinator=is_coordinator,
        )
        world_size = dist_wrapper.get_world_size()  # the file token is agreed below
        with deadline(store_budget()):  # the others wait for it in the vote below
            storage_writer.set_up_storage_writer(is_coordinator, rank=rank, world_size=world_size)
        if reusable and _same_local_layout(planner, is_coordinator, cache.local_layout):
            local_plan, layout = cache.cached_local_plan, cache.local_layout
        else:
            local_plan = storage_writer.prepare_local_plan(planner.create_local_plan())
            layout = _local_layout(planner, is_coordinator) if reusable else None
    except Exception as e:  # noqa: BLE001 - agreed with every rank below
        error = e

    central_plan: SavePlan | None = None
    global_metadata: Metadata | None = None
    loaded_reuse = False
    earlier_anywhere: bool | None = None  # known from the vote, else asked after planning
    what = f"planning the checkpoint {storage_writer.path}"
    if cache is not None and cache.cached_central_plan is not None:
        vote = _CHANGED
        if error is not None:
            vote = _FAILED
        elif local_plan == cache.cached_local_plan and (
            not is_coordinator or cache.cached_global_metadata is not None
        ):
            vote = _REUSE
        verdict, earlier_anywhere = _vote(vote, error, storage_writer, group, use_dist, what)
        if verdict == _REUSE:
            central_plan = cache.cached_central_plan
            global_metadata = cache.cached_global_metadata if is_coordinator else None
    elif cache is not None and cache.loaded_all_plans is not None:
        vote = _FAILED if error is not None else int(_matches_loaded(local_plan, cache, rank))
        verdict, earlier_anywhere = _vote(vote, error, storage_writer, group, use_dist, what)
        if verdict == _REUSE:  # every rank derives the same global plan from the loaded plans
            loaded_plans = list(cache.loaded_all_plans)
            all_plans, global_metadata = planner.create_global_plan(list(loaded_plans))
            global_metadata.all_local_plans = loaded_plans  # type: ignore[attr-defined]
            all_plans = storage_writer.prepare_global_plan(all_plans)
            central_plan = all_plans[rank]
            global_metadata = global_metadata if is_coordinator else None
            loaded_reuse = True
        cache.loaded_all_plans = None

    if central_plan is None:
        if cache is not None:
            cache.planning_rounds += 1

        def local_step() -> SavePlan:
            if error is not None:
                raise error
            assert local_plan is not None
            return local_plan

        def global_step(all_local_plans: list[SavePlan]) -> list[SavePlan]:
            nonlocal global_metadata
            local_plans = list(all_local_plans)
            _refuse_other_sizes(local_plans)
            all_local_plans, global_metadata = planner.create_global_plan(all_local_plans)
            # As NVRx does: every rank's local plan goes into the metadata, so that a job resuming
            # from this checkpoint can reuse its plan (init_checkpoint_metadata_cache).
            global_metadata.all_local_plans = local_plans  # type: ignore[attr-defined]
            return storage_writer.prepare_global_plan(all_local_plans)

        try:
            central_plan = dist_wrapper.reduce_scatter("plan", local_step, global_step)
        except CheckpointException as e:
            cleanup_after_failure(storage_writer)
            failures = {r: error_text(x[0]) for r, x in e.failures.items()}
            raise CheckpointingError(failed_on_ranks(what, failures), failures) from None

    assert central_plan is not None and local_plan is not None
    if earlier_anywhere is None:
        try:
            earlier_anywhere = _agree_token(_REUSE, storage_writer, group, use_dist, what)[1] == 0
        except CheckpointingError:
            cleanup_after_failure(storage_writer)
            raise
    if earlier_anywhere:
        _remove_earlier_saves(storage_writer, group, use_dist)
    final_plan = planner.finish_plan(central_plan)
    storage_writer.prepare_write_data(final_plan, planner)
    ret: tuple = (storage_writer, global_metadata, dist_wrapper)
    if cache is not None:
        cache.set_cache_metadata(central_plan, local_plan, loaded_reuse)
        cache.local_layout = layout  # with the plan it describes, once the planning succeeded
        ret = cache.prepare_save_state_dict_ret(rank, coordinator_rank, ret)
    return ret


def _refuse_other_sizes(plans: list[SavePlan]) -> None:
    """Raise when ranks hold a tensor of one name with other (global) sizes or dtypes: torch
    would keep one rank's and commit metadata no load accepts (a replicated value must be alike
    on every rank; a DTensor's shards name one global size)."""
    seen: dict[str, tuple[int, tuple, Any]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            data = item.tensor_data
            if data is None:
                continue
            mine = (tuple(data.size), data.properties.dtype)
            first = seen.setdefault(item.index.fqn, (rank, *mine))
            if first[1:] != mine:
                raise CheckpointingError(
                    f"{item.index.fqn!r} is a {mine[1]} tensor of size {list(mine[0])} on rank "
                    f"{rank} but {first[2]} of size {list(first[1])} on rank {first[0]}: a value "
                    "saved once for every rank must be alike on every rank (nothing was written)"
                )


def _tensor_layout(value: Any) -> tuple | None:
    """What a plain tensor's write item is made from; None for a value written as bytes."""
    if type(value) not in PLAIN_TENSOR_TYPES:
        return None
    return (
        value.dtype,
        value.shape,
        value.layout,
        value.device,
        value.requires_grad,
        value.is_pinned(),
    )


def _own_items(value: Any) -> bool:
    """A value whose write items depend on more than its key and layout (a DTensor, a sharded
    tensor, another tensor subclass, an object that makes its own)."""
    return type(value) not in PLAIN_TENSOR_TYPES and (
        isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__")
    )


def _local_layout(planner: Any, is_coordinator: bool) -> tuple | None:
    """What torch's default planner made the local plan of its (flattened) state from, or None
    where it is more than that (see the module docstring)."""
    state = planner.state_dict
    if any(_own_items(v) for v in state.values()):
        return None
    layouts = [_tensor_layout(v) for v in state.values()]
    mappings = dict(getattr(planner, "mappings", None) or {})
    return is_coordinator, list(state), layouts, mappings


def _same_local_layout(planner: Any, is_coordinator: bool, layout: tuple | None) -> bool:
    """The planner's state has ``layout`` (compared value by value: nothing is kept)."""
    if layout is None:
        return False
    coordinator, keys, layouts, mappings = layout
    state = planner.state_dict
    if coordinator != is_coordinator or len(state) != len(keys):
        return False
    for (key, value), want_key, want in zip(state.items(), keys, layouts):
        if key != want_key or _own_items(value) or _tensor_layout(value) != want:
            return False
    return (getattr(planner, "mappings", None) or {}) == mappings


def _matches_loaded(local_plan: SavePlan | None, cache: CheckpointMetadataCache, rank: int) -> bool:
    plans = cache.loaded_all_plans or []
    return local_plan is not None and rank < len(plans) and _same_plan(local_plan, plans[rank])


def _same_plan(local_plan: SavePlan, loaded: SavePlan) -> bool:
    """Equal but for ``storage_data`` (where the last save put the items)."""
    return all(
        getattr(local_plan, f.name) == getattr(loaded, f.name)
        for f in fields(local_plan)
        if f.name != "storage_data"
    )


def verify_global_md_reuse(
    loaded_all_plans: list[SavePlan] | None,
    local_plan: SavePlan,
    rank: int,
    dist_wrapper: _DistWrapper,
) -> bool:
    """NVRx's check whether the global metadata loaded with a checkpoint can serve this save: true
    on every rank iff there is one loaded plan per rank and every rank's local plan equals its loaded
    one. One all-reduce of one integer on the wrapper's group (none when there are no plans)."""
    if not loaded_all_plans or len(loaded_all_plans) != dist_wrapper.get_world_size():
        return False
    mine = int(_same_plan(local_plan, loaded_all_plans[rank]))
    what = "verifying that the loaded global metadata can be reused"
    return _min_over_ranks(mine, dist_wrapper.group, dist_wrapper.use_dist, what) == 1


def _vote(
    vote: int,
    error: BaseException | None,
    storage_writer: Writer,
    group: Any,
    use_dist: bool,
    what: str,
) -> tuple[int, bool]:
    """The smallest vote of all ranks, and whether any rank's directory holds an earlier save's
    files (the same all-reduce). When some rank failed, or the vote itself failed (a peer is gone),
    this rank's files and marker are removed and every rank raises."""
    try:
        verdict, clean = _agree_token(vote, storage_writer, group, use_dist, what)
    except CheckpointingError:
        cleanup_after_failure(storage_writer)
        raise
    if verdict == _FAILED:
        cleanup_after_failure(storage_writer)
        agree(group, use_dist, what, error)
    return verdict, not clean


def _agree_token(
    vote: int, storage_writer: Writer, group: Any, use_dist: bool, what: str
) -> tuple[int, int]:
    """One all-reduce: the smallest vote, whether no rank saw an earlier save's files
    (:func:`_clean`), and one file token for the save on every rank: the writers' own when they
    all drew the same, else one derived from the smallest of their hashes (so that the commit can
    tell from two integers that every rank named its files alike, see
    :func:`tierpoint.dcp.commit._gather_results`)."""
    n = xxhash.xxh3_64_intdigest(storage_writer.file_token.encode()) >> 16
    values = [vote, _clean(storage_writer), n, -n]
    verdict, clean, low, high = _mins_over_ranks(values, group, use_dist, what)
    if low != -high:
        storage_writer.file_token = f"{low:012x}"
    return verdict, clean


def _clean(storage_writer: Writer) -> int:
    """1 if this rank saw no earlier save's files (nor ML Flashpoint's markers of the directory) at
    set-up, else 0 (the MIN over ranks: any)."""
    return 0 if storage_writer.earlier_files or storage_writer.flashpoint_markers else 1


def _remove_earlier_saves(storage_writer: Writer, group: Any, use_dist: bool) -> None:
    """Some rank's directory holds an earlier save's data files or ``.metadata`` (the step is
    saved into again): every rank removes those it listed at set-up, and no rank writes before all
    are done (the agreement is the barrier), so that the earlier save takes no room while this one
    is written, on every node that takes part. (Reading them for this save's is ruled out anyway:
    their names carry another token.) Collective; a failure on any rank fails the save on every
    rank."""
    what = f"removing the earlier save's files from {storage_writer.path}"
    error: BaseException | None = None
    try:
        with deadline(store_budget()):
            storage_writer.remove_earlier_save()
    except CheckpointingError as e:
        error = e
    try:
        agree(group, use_dist, what, error)
    except CheckpointingError:
        cleanup_after_failure(storage_writer)
        raise


def _min_over_ranks(value: int, group: Any, use_dist: bool, what: str) -> int:
    """One all-reduce of one integer: the smallest ``value`` of all ranks."""
    return _mins_over_ranks([value], group, use_dist, what)[0]


def _mins_over_ranks(values: list[int], group: Any, use_dist: bool, what: str) -> list[int]:
    """One all-reduce of a few integers: the smallest of each over all ranks."""
    return tpdist.reduce_ints(values, "min", what, group) if use_dist else list(values)


def store_budget() -> float:
    """Seconds a rank's requests to the store between two collectives may take: half of what the
    other ranks wait there (``TIERPOINT_TIMEOUT``), so that a store that stops answering fails
    this save on every rank (its retries cut short) rather than the job's coordination."""
    return tpdist.default_timeout().total_seconds() / 2


def agree(group: Any, use_dist: bool, what: str, error: BaseException | None) -> None:
    """Collective: if any rank passes an error, every rank raises the same CheckpointingError
    (:func:`tierpoint.dist.raise_if_any_failed` on ``group``; this rank alone without ``use_dist``)."""
    if use_dist:
        tpdist.raise_if_any_failed(what, error, group)
    else:
        tpdist.raise_failures(what, [tpdist.failure_status(error)], error)


def cleanup_after_failure(writer: Writer, keep_marker: bool = False) -> None:
    """Remove what this rank wrote for a failed save (:meth:`Writer.discard`); a failure to do so
    is logged, not raised (the save's own failure is what the caller must see)."""
    try:
        with deadline(store_budget()):
            writer.discard(keep_marker=keep_marker)
    except Exception as e:  # noqa: BLE001 - the save's own failure is what the user must see
        logger.warning("cleaning up after a failed save of %s: %s", writer.path, e)
