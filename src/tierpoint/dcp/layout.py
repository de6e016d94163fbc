"""Where persistent checkpoints live, how a save in flight is marked, and which one is the latest.

Layout under a base path or URL::

    <base>/step-<N>/__<rank>_<k>.<token>.distcp  data in torch's format; a new token every save
    <base>/step-<N>/.metadata                    torch DCP metadata; written last: the commit point
    <base>/step-<N>/.unfinished-<rank>           while rank <rank> may still write into step N

Call order of a save (see :mod:`tierpoint.dcp.writer`): every rank creates its marker before writing
any data; the coordinator writes ``.metadata`` once every rank's data is durable; markers are
removed after that. :func:`get_latest_complete_checkpoint` finds the newest step that is committed
and has no marker on any rank.

Invariants:
- A step whose save was interrupted (a rank killed, a disk full, ...) is never returned: it has no
  ``.metadata``, or it still has a marker.
- Every rank returns the same answer: each lists what it sees, one rank decides from all listings
  and broadcasts the decision (listings may differ between ranks: node-local disks, stale caches).
- Names that are not ``step-<digits>`` directories are ignored.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .. import dist as tpdist
from .. import storage
from ..errors import CheckpointingError, error_text, failed_on_ranks

STEP_PREFIX = "step-"
METADATA_NAME = ".metadata"
MARKER_PREFIX = ".unfinished-"

logger = logging.getLogger("tierpoint")

_STEP = re.compile(r"^step-(\d+)$")
_MARKER = re.compile(r"^\.unfinished-(\d+)$")


def step_path(base: str | os.PathLike, step: int) -> str:
    """The directory (or URL prefix) of step ``step`` under ``base``."""
    if type(step) is not int or step < 0:
        raise CheckpointingError(f"step must be a non-negative int, got {step!r:.40}")
    return storage.join(base, f"{STEP_PREFIX}{int(step)}")


def step_of(name: str) -> int | None:
    """The step number of a ``step-<N>`` name, else ``None``."""
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def marker_name(rank: int) -> str:
    """The name of rank ``rank``'s unfinished marker inside a checkpoint directory."""
    return f"{MARKER_PREFIX}{int(rank)}"


def marker_rank(name: str) -> int | None:
    m = _MARKER.match(name)
    return int(m.group(1)) if m else None


def local_view(
    base: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> list[list]:
    """What this process sees under ``base``: ``[step, committed, [marker ranks]]`` per step dir."""
    out = []
    for name in storage.listdir(base, storage_options):
        step = step_of(name)
        if step is None:
            continue
        entries = storage.listdir(storage.join(base, name), storage_options)
        markers = sorted(r for r in map(marker_rank, entries) if r is not None)
        out.append([step, METADATA_NAME in entries, markers])
    return sorted(out)


def _merged(views: Sequence[Sequence[Sequence]]) -> tuple[set[int], dict[int, set[int]]]:
    """The steps committed in some view, and the marker ranks each step has in any view."""
    committed: set[int] = set()
    markers: dict[int, set[int]] = {}
    for view in views:
        for step, has_metadata, ranks in view:
            if has_metadata:
                committed.add(int(step))
            if ranks:
                markers.setdefault(int(step), set()).update(int(r) for r in ranks)
    return committed, markers


def complete_steps(views: Sequence[Sequence[Sequence]]) -> list[int]:
    """Steps committed in some view and marked unfinished in none, newest first (``views``: one
    :func:`local_view` per rank)."""
    committed, markers = _merged(views)
    return sorted(committed - set(markers), reverse=True)


def choose_latest(views: Sequence[Sequence[Sequence]]) -> int | None:
    """The newest step committed in some view and marked unfinished in none."""
    return next(iter(complete_steps(views)), None)


def warn_skipped(base: str, views: Sequence[Sequence[Sequence]], latest: int | None) -> None:
    """A WARNING for each step newer than ``latest`` that is committed in some view but still
    marked unfinished (a save into it did not finish its clean-up, or a node kept a marker of an
    earlier one): an older step loads, and the user should know why."""
    committed, markers = _merged(views)
    for step in sorted(committed & set(markers), reverse=True):
        if latest is None or step > latest:
            logger.warning(
                "%s has a .metadata but unfinished markers of rank(s) %s (a save into it did not "
                "finish): it is not loaded. Save it again (overwrite=True), or remove it",
                step_path(base, step),
                ", ".join(map(str, sorted(markers[step]))),
            )


def get_latest_complete_checkpoint(
    base: str | os.PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
    group: Any = None,
    node_local: bool = False,
) -> str | None:
    """The path of the newest complete ``step-<N>`` under ``base``, the same on every rank (else
    ``None``).

    Collective when ``torch.distributed`` is initialised: every rank of ``group`` (default:
    tierpoint's coordination group) must call it. Without ``torch.distributed`` it decides alone.

    ``node_local=True``: ``base`` is a directory on each node's own disk. Candidates are tried newest
    first; for each, the files this node's ranks need and lack are fetched from the peers that
    hold them (:mod:`tierpoint.dcp.retrieval`); a candidate with a file that exists nowhere is
    skipped. The returned step is then loadable from ``base`` on every node.
    """
    base = storage.checkpoint_path(base, "base")
    if node_local:
        return _latest_node_local(base, storage_options, group)
    views = _gather_views(base, storage_options, group)
    decision = None
    if tpdist.get_rank() == _decider(group):
        decision = choose_latest([v["view"] for v in views])
        warn_skipped(base, [v["view"] for v in views], decision)
    step = tpdist.broadcast_json(
        decision, _decider(group), f"agreeing on the latest checkpoint under {base}", group=group
    )
    return None if step is None else step_path(base, int(step))


def _gather_views(
    base: str | os.PathLike, storage_options: Mapping[str, Any] | None, group: Any
) -> list[dict]:
    mine: list[list] | None = None
    error: str | None = None
    try:
        mine = local_view(base, storage_options)
    except Exception as e:  # noqa: BLE001 - shared with every rank below
        error = error_text(e)
    views = tpdist.all_gather_json(
        {"view": mine, "error": error}, f"listing checkpoints under {base}", group=group
    )
    failures = {r: v["error"] for r, v in enumerate(views) if v["error"]}
    if failures:
        raise CheckpointingError(
            failed_on_ranks(f"listing checkpoints under {base}", failures), failures
        )
    return views


def _latest_node_local(
    base: str | os.PathLike, storage_options: Mapping[str, Any] | None, group: Any
) -> str | None:
    if not storage.is_local(base):
        raise ValueError(f"node_local needs a local directory, got {base}")
    from .retrieval import retrieve_missing

    views = _gather_views(base, storage_options, group)
    # Every rank holds every view, so every rank walks the same candidates in the same order.
    found = None
    for step in complete_steps([v["view"] for v in views]):
        if retrieve_missing(step_path(base, step)):
            found = step
            break
    if tpdist.get_rank() == _decider(group):
        warn_skipped(str(base), [v["view"] for v in views], found)
    return None if found is None else step_path(base, found)


def _decider(group: Any) -> int:
    """The global rank that decides: the lowest rank of ``group``."""
    if group is None or not tpdist.is_distributed():
        return 0
    import torch.distributed as dist

    return dist.get_global_rank(group, 0)
