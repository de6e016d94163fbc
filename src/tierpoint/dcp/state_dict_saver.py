"""A DCP save split into plan / write / finalize, with planning cached across saves (NVRx names).

Call order (every rank, same points)::

    writer = Writer(step_dir)
    writer, metadata, dist_wrapper = save_state_dict_async_plan(
        state_dict, writer, enable_cache=True, metadata_cache=cache)
    writer.write_now()                   # or: async_fn, preload_fn, args = writer.get_save_function_and_args()
    save_state_dict_async_finalize(writer, metadata, dist_wrapper)

Planning is torch's: ``DefaultSavePlanner`` (or the planner given) makes each rank's local plan, the
coordinator merges them into the global plan and the ``Metadata``. With a
:class:`CheckpointMetadataCache`, every later save recomputes only its local plan (no
communication) and compares it with the cached one; one all-reduce of one integer tells every rank
whether all local plans are unchanged. If so, the cached central plan and (on the coordinator)
the cached metadata are reused: no gather, no scatter. If any rank's layout changed, all ranks plan
again (a changed layout is never missed).

The global metadata carries every rank's local plan as ``all_local_plans`` (NVRx's attribute), so a
job resuming from a checkpoint can seed its cache with ``init_checkpoint_metadata_cache(
read_metadata(step_dir))`` and reuse the loaded plans from its first save (one all-reduce).

Finalize: one all-reduce of a few integers tells whether no rank failed, every rank wrote into the
same directory under the save's file token (agreed while planning, see
:mod:`tierpoint.dcp.file_plan`), and every rank's write results equal those of the last commit of
its cache (an unchanged layout). If so, nothing is gathered: the coordinator commits the results
it remembers under the new token (O(1) bytes per rank at any world size). Otherwise the results
go to the coordinator alone, or, when some rank failed, every payload to every rank so that each
raises the same error. The coordinator writes ``.metadata`` (the commit), every rank learns the
outcome, then unfinished markers are removed.
Whatever the outcome, the writer's staging buffer then goes back to its pool, so a caller who
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

import json
import logging
import os
import posixpath
import zlib
from dataclasses import fields
from typing import Any

import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper

from .. import dist as tpdist
from .. import storage
from ..errors import CheckpointingError, error_text, failed_on_ranks
from .file_plan import add_token, remove_token
from .writer import Writer

logger = logging.getLogger("tierpoint")

_REUSE, _CHANGED, _FAILED = 1, 0, -1


class CheckpointMetadataCache:
    """What a save can reuse from earlier saves of the same state layout.

    Attributes (NVRx names): ``cached_central_plan`` (this rank's part of the global plan),
    ``cached_local_plan``, ``cached_global_metadata`` (coordinator only), ``validated_cache_reuse``
    (the last save reused the cached plan), ``validated_loaded_metadata_reuse`` (the last save reused
    plans loaded with :meth:`set_cached_global_metadata`), ``loaded_all_plans``.
    tierpoint adds ``planning_rounds``: how many saves ran the planning collectives.

    One cache serves one sequence of saves of one kind of state on one process group; all ranks
    must use caching alike.
    """

    def __init__(self) -> None:
        self.cached_central_plan: SavePlan | None = None
        self.cached_local_plan: SavePlan | None = None
        self.cached_global_metadata: Metadata | None = None
        self.validated_cache_reuse = False
        self.validated_loaded_metadata_reuse = False
        self.loaded_all_plans: list[SavePlan] | None = None
        self.planning_rounds = 0
        # The last commit of this cache's saves, the same on every rank: (digest of this rank's
        # write results, coordinator, world size); on the coordinator every rank's results too.
        self._committed: tuple[str, int, int] | None = None
        self._committed_results: list[list] | None = None

    def set_cached_global_metadata(self, cached_global_metadata: Metadata) -> None:
        """Seed the cache from a loaded checkpoint's metadata. If it carries ``all_local_plans``
        (every rank's local plan), the next save can skip planning when all ranks' plans match it."""
        self.cached_global_metadata = cached_global_metadata
        self.loaded_all_plans = getattr(cached_global_metadata, "all_local_plans", None)
        if self.loaded_all_plans is None:
            logger.debug("metadata has no all_local_plans: the first save will plan")

    def set_cache_metadata(
        self, central_plan: SavePlan, local_plan: SavePlan, global_md_verify_reuse: bool
    ) -> None:
        """Record the plans of the save just planned."""
        self.validated_loaded_metadata_reuse = global_md_verify_reuse
        self.validated_cache_reuse = (
            central_plan is self.cached_central_plan
        )  # reused, not replanned
        self.cached_central_plan = central_plan
        self.cached_local_plan = local_plan

    def prepare_save_state_dict_ret(
        self, rank: int, coordinator: int, save_state_dict_ret: tuple
    ) -> tuple:
        """Fill in (coordinator) or remember the global metadata of ``save_state_dict_ret``."""
        writer, metadata, dist_wrapper = save_state_dict_ret
        if rank != coordinator:
            return writer, None, dist_wrapper
        if metadata is None:
            metadata = self.cached_global_metadata
        else:
            self.cached_global_metadata = metadata
        return writer, metadata, dist_wrapper

    def get_cache_metadata(self) -> tuple:
        """``(cached_central_plan, cached_local_plan, validated_cache_reuse, loaded_all_plans)``."""
        return (
            self.cached_central_plan,
            self.cached_local_plan,
            self.validated_cache_reuse,
            self.loaded_all_plans,
        )

    def get_metadata_caching_status(self) -> tuple[bool, bool]:
        return self.validated_cache_reuse, self.validated_loaded_metadata_reuse

    def forget_results(self) -> None:
        """Drop the remembered write results (after a failed finalize, every rank alike)."""
        self._committed = None
        self._committed_results = None


_checkpoint_metadata_cache: CheckpointMetadataCache | None = None


def init_checkpoint_metadata_cache(cached_global_metadata: Metadata) -> None:
    """Create the process-wide cache (if needed) and seed it with loaded metadata."""
    default_metadata_cache().set_cached_global_metadata(cached_global_metadata)


def default_metadata_cache() -> CheckpointMetadataCache:
    """The process-wide cache used when caching is enabled and no cache is given."""
    global _checkpoint_metadata_cache
    if _checkpoint_metadata_cache is None:
        _checkpoint_metadata_cache = CheckpointMetadataCache()
    return _checkpoint_metadata_cache


def require_state_dict(state_dict: Any) -> None:
    """A DCP state dict is a dict of tensors and values; anything else is a clear error."""
    if not isinstance(state_dict, dict):
        raise CheckpointingError(
            f"state_dict must be a dict (e.g. {{'model': model.state_dict()}}), got "
            f"{type(state_dict).__name__}"
        )


def get_metadata_caching_status() -> tuple[bool, bool] | None:
    if _checkpoint_metadata_cache is None:
        return None
    return _checkpoint_metadata_cache.get_metadata_caching_status()


# --------------------------------------------------------------------------------------- planning


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
    dist_wrapper = _DistWrapper(group, use_dist, coordinator_rank)
    planner = planner if planner is not None else DefaultSavePlanner()
    cache = (metadata_cache or default_metadata_cache()) if enable_cache else None
    storage_writer.metadata_cache = cache
    rank, is_coordinator = dist_wrapper.get_rank(), dist_wrapper.is_coordinator

    local_plan: SavePlan | None = None
    error: BaseException | None = None
    try:
        require_state_dict(state_dict)
        planner.set_up_planner(
            state_dict=state_dict,
            storage_meta=storage_writer.storage_meta(),
            is_coordinator=is_coordinator,
        )
        storage_writer.set_up_storage_writer(is_coordinator, rank=rank)
        local_plan = storage_writer.prepare_local_plan(planner.create_local_plan())
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
            all_local_plans, global_metadata = planner.create_global_plan(all_local_plans)
            # As NVRx does: every rank's local plan goes into the metadata, so that a job resuming
            # from this checkpoint can reuse its plan (init_checkpoint_metadata_cache).
            global_metadata.all_local_plans = local_plans  # type: ignore[attr-defined]
            return storage_writer.prepare_global_plan(all_local_plans)

        try:
            central_plan = dist_wrapper.reduce_scatter("plan", local_step, global_step)
        except CheckpointException as e:
            _cleanup_after_failure(storage_writer)
            failures = {r: error_text(x[0]) for r, x in e.failures.items()}
            raise CheckpointingError(failed_on_ranks(what, failures), failures) from None

    assert central_plan is not None and local_plan is not None
    if earlier_anywhere is None:
        try:
            earlier_anywhere = _agree_token(_REUSE, storage_writer, group, use_dist, what)[1] == 0
        except CheckpointingError:
            _cleanup_after_failure(storage_writer)
            raise
    if earlier_anywhere:
        _remove_earlier_saves(storage_writer, group, use_dist)
    final_plan = planner.finish_plan(central_plan)
    storage_writer.prepare_write_data(final_plan, planner)
    ret: tuple = (storage_writer, global_metadata, dist_wrapper)
    if cache is not None:
        cache.set_cache_metadata(central_plan, local_plan, loaded_reuse)
        ret = cache.prepare_save_state_dict_ret(rank, coordinator_rank, ret)
    return ret


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
        _cleanup_after_failure(storage_writer)
        raise
    if verdict == _FAILED:
        _cleanup_after_failure(storage_writer)
        _agree(group, use_dist, what, error)
    return verdict, not clean


def _agree_token(
    vote: int, storage_writer: Writer, group: Any, use_dist: bool, what: str
) -> tuple[int, int]:
    """One all-reduce: the smallest vote, whether no rank saw an earlier save's files
    (:func:`_clean`), and one file token for the save on every rank: the writers' own when they
    all drew the same, else one derived from the smallest of their hashes (so that the commit can
    tell from two integers that every rank named its files alike, see :func:`_gather_results`)."""
    n = xxhash.xxh3_64_intdigest(storage_writer.file_token.encode()) >> 16
    values = [vote, _clean(storage_writer), n, -n]
    verdict, clean, low, high = _mins_over_ranks(values, group, use_dist, what)
    if low != -high:
        storage_writer.file_token = f"{low:012x}"
    return verdict, clean


def _clean(storage_writer: Writer) -> int:
    """1 if this rank saw no earlier save's files at set-up, else 0 (the MIN over ranks: any)."""
    return 0 if storage_writer.earlier_files else 1


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
        storage_writer.remove_earlier_save()
    except CheckpointingError as e:
        error = e
    try:
        _agree(group, use_dist, what, error)
    except CheckpointingError:
        _cleanup_after_failure(storage_writer)
        raise


def _min_over_ranks(value: int, group: Any, use_dist: bool, what: str) -> int:
    """One all-reduce of one integer: the smallest ``value`` of all ranks."""
    return _mins_over_ranks([value], group, use_dist, what)[0]


def _mins_over_ranks(values: list[int], group: Any, use_dist: bool, what: str) -> list[int]:
    """One all-reduce of a few integers: the smallest of each over all ranks."""
    return tpdist.reduce_ints(values, "min", what, group) if use_dist else list(values)


def _agree(group: Any, use_dist: bool, what: str, error: BaseException | None) -> None:
    """Collective: if any rank passes an error, every rank raises the same CheckpointingError
    (:func:`tierpoint.dist.raise_if_any_failed` on ``group``; this rank alone without ``use_dist``)."""
    if use_dist:
        tpdist.raise_if_any_failed(what, error, group)
    else:
        tpdist.raise_failures(what, [tpdist.failure_status(error)], error)


def _cleanup_after_failure(writer: Writer, keep_marker: bool = False) -> None:
    try:
        writer.discard(keep_marker=keep_marker)
    except Exception as e:  # noqa: BLE001 - the save's own failure is what the user must see
        logger.warning("cleaning up after a failed save of %s: %s", writer.path, e)


# --------------------------------------------------------------------------------------- finalize


def _encode_results(results: list[WriteResult], token: str) -> list:
    """JSON-ready results; file names without the save's ``token`` (so that the results of saves of
    an unchanged layout are equal, see :func:`_gather_results`)."""
    out = []
    for wr in results:
        info = wr.storage_data
        idx = wr.index
        offset = list(idx.offset) if idx.offset is not None else None
        out.append(
            [
                idx.fqn,
                offset,
                idx.index,
                wr.size_in_bytes,
                remove_token(info.relative_path, token),
                info.offset,
                info.length,
            ]
        )
    return out


def _decode_results(encoded: list, token: str) -> list[WriteResult]:
    return [
        WriteResult(
            index=MetadataIndex(fqn, offset, index),
            size_in_bytes=size,
            storage_data=_StorageInfo(add_token(path, token), file_offset, length),
        )
        for fqn, offset, index, size, path, file_offset, length in encoded
    ]


def save_state_dict_async_finalize(
    storage_writer: Writer, global_metadata: Metadata | None, dist_wrapper: _DistWrapper
) -> None:
    """Commit a planned and written save, then release its staging buffer (every rank; see the
    module docstring)."""
    try:
        _commit(storage_writer, global_metadata, dist_wrapper)
    finally:
        storage_writer.release_staging()


def _commit(
    storage_writer: Writer, global_metadata: Metadata | None, dist_wrapper: _DistWrapper
) -> None:
    cache: CheckpointMetadataCache | None = getattr(storage_writer, "metadata_cache", None)
    use_dist = dist_wrapper.use_dist
    group = dist_wrapper.group if use_dist else None
    path = storage_writer.path
    token = storage_writer.results_token
    payload: dict[str, Any]
    try:
        payload = {"results": _encode_results(storage_writer.retrieve_write_results(), token)}
    except Exception as e:  # noqa: BLE001 - agreed below
        payload = {"error": error_text(e)[:2000]}
    payload["directory"] = posixpath.basename(os.fspath(path).rstrip("/"))
    payload["token"] = token
    committed = _commit_key(payload, dist_wrapper)
    what = f"writing the checkpoint {path}"
    try:
        gathered = _gather_results(payload, committed, cache, dist_wrapper, what)
    except CheckpointingError:
        _fail_everywhere(storage_writer, cache)
        raise
    failures = {r: p["error"] for r, p in enumerate(gathered or []) if "error" in p}
    names = [p.get("directory") for p in gathered or []]
    if not failures and len(set(names)) > 1:  # node-local paths may differ, the step may not
        failures = {r: f"saved into {name!r}" for r, name in enumerate(names)}
        what = "saving a checkpoint (every rank must pass the same step directory)"
    if failures:
        _fail_everywhere(storage_writer, cache)
        raise CheckpointingError(failed_on_ranks(what, failures), failures)

    error: BaseException | None = None
    commit_unknown = False
    encoded: list[list] | None = None
    if dist_wrapper.is_coordinator:
        try:
            if gathered is None:  # every rank's results are those of the last commit
                encoded = cache._committed_results if cache is not None else None
                if encoded is None:
                    raise CheckpointingError("the coordinator lost the results of the last commit")
            else:
                encoded = [p["results"] for p in gathered]
            if global_metadata is None:
                raise CheckpointingError("the coordinator has no global metadata to commit")
            commit_unknown = not storage.is_local(path)
            storage_writer.commit(global_metadata, [_decode_results(e, token) for e in encoded])
            commit_unknown = False
        except Exception as e:  # noqa: BLE001 - agreed below
            error = e
    try:
        _agree(group, use_dist, f"committing the checkpoint {path}", error)
    except CheckpointingError:
        # An object store may still apply a .metadata upload whose reply never came (a timeout):
        # the coordinator's marker then stays, so that the step can never look complete.
        _fail_everywhere(storage_writer, cache, keep_marker=commit_unknown)
        raise
    if cache is not None:  # every rank alike: the commit is agreed
        cache._committed, cache._committed_results = committed, encoded

    error = None
    try:
        storage_writer.remove_markers(every_visible=dist_wrapper.is_coordinator)
    except Exception as e:  # noqa: BLE001 - agreed below
        error = e
    _agree(group, use_dist, f"removing the unfinished markers of {path} (committed)", error)


def _commit_key(payload: dict, dist_wrapper: _DistWrapper) -> tuple[str, int, int] | None:
    """What this rank remembers of a commit: a digest of its write results (file names without
    the save's token), the coordinator and the world size."""
    if "results" not in payload:
        return None
    digest = xxhash.xxh3_128_hexdigest(json.dumps(payload["results"]).encode())
    return digest, dist_wrapper.global_coordinator_rank, dist_wrapper.get_world_size()


def _gather_results(
    payload: dict,
    committed: tuple[str, int, int] | None,
    cache: CheckpointMetadataCache | None,
    dist_wrapper: _DistWrapper,
    what: str,
) -> list[dict] | None:
    """What the coordinator needs to commit, in the fewest bytes; one all-reduce decides:

    - no rank failed, one directory, one file token, and every rank's results equal those of the
      last commit of its cache (an unchanged layout, the common case): nothing is gathered
      (``None`` everywhere; the coordinator commits the remembered results under the new token);
    - no rank failed and one directory: every rank's results on the coordinator alone (``None``
      elsewhere);
    - otherwise every rank's payload on every rank, so that each raises the same error."""
    h = _hash31(payload["directory"])
    t = _hash31(payload["token"])
    same = committed is not None and cache is not None and cache._committed == committed
    values = ["error" not in payload, h, -h, t, -t, same]
    if not dist_wrapper.use_dist:
        return None if values[0] and same else [payload]
    group = dist_wrapper.group
    low = tpdist.reduce_ints(values, "min", what, group)
    ok, one_directory, one_token, all_same = (
        low[0] == 1,
        low[1] == -low[2],
        low[3] == -low[4],
        low[5],
    )
    if ok and one_directory and one_token and all_same:
        return None
    if ok and one_directory:
        gathered = tpdist.gather_json(payload, dist_wrapper.global_coordinator_rank, what, group)
        return gathered if gathered is not None else []
    return tpdist.all_gather_json(payload, what, group=group)


def _hash31(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _fail_everywhere(
    writer: Writer, cache: CheckpointMetadataCache | None, keep_marker: bool = False
) -> None:
    if cache is not None:
        cache.forget_results()
    _cleanup_after_failure(writer, keep_marker)
