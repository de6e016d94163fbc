"""Where persistent checkpoints live, how a save in flight is marked, and which one is the latest.

Layout under a base path or URL::

    <base>/step-<N>/__<rank>_<k>.<token>.distcp  data in torch's format; a new token every save
    <base>/step-<N>/.metadata                    torch DCP metadata; written last: the commit point
    <base>/step-<N>/.unfinished-<rank>           while rank <rank> may still write into step N

ML Flashpoint's layout is recognised too (read, listed, offered as the latest): ``<base>/step-<N>_ckpt/``
directories, unfinished while a sibling ``<base>/step-<N>_ckpt__<local rank>__unfinished`` marker
(any name that starts with the directory's name and ends with ``unfinished``) exists, like
tierpoint's own markers inside it. When both ``step-<N>`` and ``step-<N>_ckpt`` are complete, the
first is taken. Retention (:mod:`tierpoint.tiered.retention`) and :func:`local_view` know only
tierpoint's own layout: another program's directories are never removed.

Names are :mod:`tierpoint.dcp.names`' (re-exported here). Call order of a save (see
:mod:`tierpoint.dcp.writer`): every rank creates its marker before writing any data; the coordinator
writes ``.metadata`` once every rank's data is durable; markers are removed after that. Finding the
newest complete step: :func:`gather_views` (the listings, one per node, collective), then
:func:`complete_dirs` (committed, and marked on no rank); :func:`complete_checkpoints` does both,
and :func:`tierpoint.dcp.latest.get_latest_complete_checkpoint` (which may also fetch missing files
from peers) is built on them.

Invariants:
- A step whose save was interrupted (a rank killed, a disk full, ...) is never returned: it has no
  ``.metadata``, or it still has a marker.
- Every rank returns the same answer: each lists what it sees, one rank decides from all listings
  and broadcasts the decision (listings may differ between ranks: node-local disks, stale caches).
- Names that are not ``step-<digits>`` (or ``step-<digits>_ckpt``) directories are ignored.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import dist as tpdist
from .. import storage
from ..errors import CheckpointingError, error_text, failed_on_ranks
from .names import (
    MARKER_PREFIX,
    METADATA_NAME,
    STEP_PREFIX,
    UNKNOWN_RANK,
    checkpoint_id_or_path,
    marker_name,
    marker_rank,
    sibling_markers,
    step_dir_of,
    step_of,
    step_path,
)

logger = logging.getLogger("tierpoint")


def local_view(
    base: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> list[list]:
    """What this process sees under ``base``: ``[step, committed, [marker ranks]]`` per ``step-<N>``
    directory (tierpoint's own layout only)."""
    return [
        [step, committed, markers]
        for name, step, committed, markers in local_listing(base, storage_options)
        if step_of(name) is not None
    ]


def local_listing(
    base: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> list[list]:
    """``[name, step, committed, [marker ranks]]`` per step directory under ``base``, in either
    layout (ML Flashpoint's sibling markers count as markers of their directory), oldest first."""
    names = storage.listdir(base, storage_options)
    outside = sibling_markers(names)
    steps = [(name, step) for name in names if (step := step_dir_of(name)) is not None]
    out = []
    listings = _list_each(base, [name for name, _ in steps], storage_options)
    for (name, step), entries in zip(steps, listings):
        markers = {r for r in map(marker_rank, entries) if r is not None}
        markers.update(outside.get(name, ()))
        out.append([name, step, METADATA_NAME in entries, sorted(markers)])
    return sorted(out, key=_age)


_LISTING_THREADS = 8
"""Step directories of an object store listed at once (each listing is a round trip)."""


def _list_each(
    base: str | os.PathLike, names: list[str], storage_options: Mapping[str, Any] | None
) -> list[list[str]]:
    """The listing of each directory ``names`` under ``base``, in order: on an object store
    several at a time (a run of a hundred steps: a hundred round trips, most of a restart's wait
    otherwise), on a file system one by one."""
    paths = [storage.join(base, name) for name in names]
    if storage.is_local(base) or len(paths) < 2:
        return [storage.listdir(path, storage_options) for path in paths]
    with ThreadPoolExecutor(min(_LISTING_THREADS, len(paths)), "tierpoint-listing") as pool:
        return list(pool.map(lambda path: storage.listdir(path, storage_options), paths))


def _age(entry: Sequence) -> tuple[int, bool]:
    """Order of ``[name, step, ...]`` entries: by step; tierpoint's own name after (newer than)
    ML Flashpoint's of the same step, so that it is preferred."""
    return int(entry[1]), step_of(entry[0]) is not None


def _merged(views: Sequence[Sequence[Sequence]]) -> tuple[set[Any], dict[Any, set[int]]]:
    """The steps (or names) committed in some view, and the marker ranks each has in any view."""
    committed: set[Any] = set()
    markers: dict[Any, set[int]] = {}
    for view in views:
        for key, has_metadata, ranks in view:
            key = key if isinstance(key, str) else int(key)
            if has_metadata:
                committed.add(key)
            if ranks:
                markers.setdefault(key, set()).update(int(r) for r in ranks)
    return committed, markers


def complete_dirs(listings: Sequence[Sequence[Sequence]]) -> list[str]:
    """Names of the step directories committed in some listing and marked unfinished in none,
    newest first (``listings``: one :func:`local_listing` per rank)."""
    steps = {str(name): int(step) for listing in listings for name, step, _, _ in listing}
    committed, markers = _merged([[[e[0], e[2], e[3]] for e in listing] for listing in listings])
    complete = [[name, steps[name]] for name in committed - set(markers)]
    return [name for name, _ in sorted(complete, key=_age, reverse=True)]


def complete_steps(views: Sequence[Sequence[Sequence]]) -> list[int]:
    """Steps committed in some view and marked unfinished in none, newest first (``views``: one
    :func:`local_view` per rank)."""
    committed, markers = _merged(views)
    return sorted(committed - set(markers), reverse=True)


def choose_latest(views: Sequence[Sequence[Sequence]]) -> int | None:
    """The newest step committed in some view and marked unfinished in none."""
    return next(iter(complete_steps(views)), None)


def warn_skipped(views: Sequence[dict], latest: str | None) -> None:
    """A WARNING for each step directory newer than ``latest`` (a name) that is committed in some
    listing but still marked unfinished (a save into it did not finish its clean-up, or a node kept
    a marker of an earlier one): an older step loads, and the user should know why. The directory
    is named as the ranks whose listing held the markers see it (``views``: :func:`gather_views`'s;
    each node lists its own directory when the base is node-local)."""
    listings = [v["view"] for v in views]
    steps = {str(e[0]): int(e[1]) for listing in listings for e in listing}
    committed, markers = _merged([[[e[0], e[2], e[3]] for e in listing] for listing in listings])
    newest = None if latest is None else steps.get(latest)
    for name in sorted(committed & set(markers), key=lambda n: steps[n], reverse=True):
        if newest is None or steps[name] > newest:
            ranks = ["?" if r == UNKNOWN_RANK else str(r) for r in sorted(markers[name])]
            seen_in = dict.fromkeys(
                storage.join(v["base"], name)
                for v in views
                if any(e[0] == name and e[3] for e in v["view"])
            )
            logger.warning(
                "%s has a .metadata but unfinished markers of rank(s) %s%s (a save into it did "
                "not finish): it is not loaded. Save it again (overwrite=True), or remove it",
                ", ".join(seen_in),
                ", ".join(ranks),
                ""
                if step_of(name) is not None
                else " (global ranks for tierpoint's markers inside the directory, ranks on "
                "that node for ML Flashpoint's beside it)",
            )


def complete_checkpoints(
    base: str | os.PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
    group: Any = None,
) -> list[str]:
    """The paths of every complete step directory under ``base``, newest first, decided from every
    rank's listing (collective, like
    :func:`~tierpoint.dcp.latest.get_latest_complete_checkpoint`; no retrieval)."""
    base = storage.checkpoint_path(base, "base")
    views = gather_views(base, storage_options, group)
    return [storage.join(base, name) for name in complete_dirs([v["view"] for v in views])]


def gather_views(
    base: str | os.PathLike, storage_options: Mapping[str, Any] | None, group: Any
) -> list[dict]:
    """Listings of ``base`` (``{"view": [...], "base": <the lister's base>}`` each; the listings
    are merged, so an empty one is neutral). Collective; raises the same
    :class:`CheckpointingError` on every rank when a rank could not list.

    Without a ``group`` of the caller's, the listings travel merged per node
    (:func:`tierpoint.dist.gather_by_node`; a node's identical listings count once): O(nodes)
    bytes per rank. When every rank names the same ``base`` (one all-reduce of its hash tells) only
    one rank per node lists it (on an object store, only the decider: one listing serves the job).
    With a caller's ``group`` (its ranks need not cover a node) every rank lists and every listing
    reaches every rank of the group."""
    lists = not _same_base(base, group) or _lists_for_others(base, group)
    mine: list[list] | None = []
    error: str | None = None
    try:
        if lists:
            mine = local_listing(base, storage_options)
    except Exception as e:  # noqa: BLE001 - shared with every rank below
        error = error_text(e)
    what = f"listing checkpoints under {base}"
    errors = {str(tpdist.get_rank()): error} if error else {}
    report = {"view": mine, "base": os.fspath(base), "errors": errors}
    if group is None and tpdist.is_distributed():
        views = [v for record in tpdist.gather_by_node(report, _merge_views, what) for v in record]
    else:
        views = tpdist.all_gather_json(report, what, group=group)
    failures = {int(r): text for v in views for r, text in v["errors"].items()}
    if failures:
        raise CheckpointingError(failed_on_ranks(what, failures), failures)
    return views


def _merge_views(reports: list[dict]) -> list[dict]:
    """A node's distinct listings (ranks that see one directory list the same)."""
    distinct: dict[str, dict] = {}
    for report in reports:
        distinct.setdefault(json.dumps(report, sort_keys=True), report)
    return list(distinct.values())


def _same_base(base: str | os.PathLike, group: Any) -> bool:
    """Whether every rank names the same ``base`` and no caller's ``group`` is given (a caller's
    group's ranks need not cover a node). One all-reduce when distributed."""
    if not tpdist.is_distributed() or group is not None:
        return False
    h = zlib.crc32(os.fspath(base).encode()) & 0x7FFFFFFF
    low, high = tpdist.reduce_ints([h, -h], "min", f"comparing checkpoint bases {base}")
    return low == -high


def _lists_for_others(base: str | os.PathLike, group: Any) -> bool:
    """Whether this rank lists a ``base`` every rank names: on an object store only the decider
    (one listing serves the job), on a local path the first rank of each node (a node's ranks see
    one directory)."""
    if not storage.is_local(base):
        return tpdist.get_rank() == decider(group)
    return tpdist.node_layout().local_rank == 0


def decider(group: Any) -> int:
    """The global rank that decides: the lowest rank of ``group``."""
    if group is None or not tpdist.is_distributed():
        return 0
    import torch.distributed as dist

    return dist.get_global_rank(group, 0)


__all__ = [
    "MARKER_PREFIX",
    "METADATA_NAME",
    "STEP_PREFIX",
    "UNKNOWN_RANK",
    "checkpoint_id_or_path",
    "choose_latest",
    "complete_checkpoints",
    "complete_dirs",
    "complete_steps",
    "decider",
    "gather_views",
    "local_listing",
    "local_view",
    "marker_name",
    "marker_rank",
    "sibling_markers",
    "step_dir_of",
    "step_of",
    "step_path",
    "warn_skipped",
]
