"""Finalizing a DCP save: the commit step of plan / write / finalize.

Call order: :func:`save_state_dict_async_finalize` on every rank once the writer wrote (after
:func:`tierpoint.dcp.planning.save_state_dict_async_plan`). One all-reduce of a few integers
(:func:`_gather_results`) tells whether no rank failed, every rank wrote into the same directory
under the save's file token (agreed while planning, see :mod:`tierpoint.dcp.file_plan`), and every
rank's write results equal those of the last commit of its cache (an unchanged layout). If so,
nothing is gathered: the coordinator commits the results it remembers under the new token (O(1)
bytes per rank at any world size). Otherwise the results go to the coordinator alone, or, when some
rank failed, every payload to every rank so that each raises the same error. The coordinator writes
``.metadata`` (the commit), every rank learns the outcome, then unfinished markers are removed.
Whatever the outcome, the writer's staging buffer then goes back to its pool.

Invariants:
- ``.metadata`` is written only when every rank's data is durable; a failure on any rank raises the
  same :class:`~tierpoint.errors.CheckpointingError` on every rank and removes the save's data files
  (an object store's ``.metadata`` upload of unknown outcome keeps the coordinator's marker).
- The coordinator's requests to the store between two collectives end within half of
  ``TIERPOINT_TIMEOUT`` (:func:`~tierpoint.storage.retries.deadline`): a store that stops answering
  fails the save, never the other ranks' wait.
- Write results travel as JSON, their file names without the save's token, so that the results of
  saves of an unchanged layout are equal (the very same rows: :mod:`tierpoint.dcp.write_results`);
  the cache remembers them on every rank alike, and forgets them on every rank after a failure.
"""

from __future__ import annotations

import os
import posixpath
import zlib
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.utils import _DistWrapper

from .. import dist as tpdist
from .. import storage
from ..errors import CheckpointingError, error_text, failed_on_ranks
from ..storage.retries import deadline
from .metadata_cache import CheckpointMetadataCache
from .planning import agree, cleanup_after_failure, store_budget
from .writer import Writer


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
    committed: tuple[str, int, int] | None = None
    try:
        results = storage_writer.kept_results()
        payload = {"results": results.rows}
        committed = (  # what this rank remembers of the commit
            results.digest,
            dist_wrapper.global_coordinator_rank,
            dist_wrapper.get_world_size(),
        )
    except Exception as e:  # noqa: BLE001 - agreed below
        payload = {"error": error_text(e)[:2000]}
    payload["directory"] = posixpath.basename(os.fspath(path).rstrip("/"))
    payload["token"] = token
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
            with deadline(store_budget()):  # the others wait for its outcome below
                storage_writer.commit(global_metadata, encoded)
            commit_unknown = False
        except Exception as e:  # noqa: BLE001 - agreed below
            error = e
    try:
        agree(group, use_dist, f"committing the checkpoint {path}", error)
    except CheckpointingError:
        # An object store may still apply a .metadata upload whose reply never came (a timeout):
        # the coordinator's marker then stays, so that the step can never look complete.
        _fail_everywhere(storage_writer, cache, keep_marker=commit_unknown)
        raise
    if cache is not None:  # every rank alike: the commit is agreed
        cache._committed, cache._committed_results = committed, encoded

    error = None
    try:
        with deadline(store_budget()):
            storage_writer.remove_markers(every_visible=dist_wrapper.is_coordinator)
    except Exception as e:  # noqa: BLE001 - agreed below
        error = e
    agree(group, use_dist, f"removing the unfinished markers of {path} (committed)", error)


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
    - no rank failed and one directory: every rank's results on the coordinator alone (an empty
      list elsewhere);
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
    cleanup_after_failure(writer, keep_marker)
