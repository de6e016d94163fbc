"""The newest complete persistent checkpoint, fetching from peers what a node-local one lacks.

Call order: every rank of the group calls :func:`get_latest_complete_checkpoint` at the same point
(collective when ``torch.distributed`` is initialised): every rank's listing is gathered
(:func:`tierpoint.dcp.step_dirs.gather_views`); for a shared base one rank decides and broadcasts; for a
node-local base every rank walks the same candidates newest first and, for each, fetches the files
its node lacks (:func:`tierpoint.dcp.peer_fetch.retrieve_missing`) until one is complete everywhere.

Invariants: every rank returns the same path (or ``None``); a step whose save was interrupted is
never returned (see :mod:`tierpoint.dcp.step_dirs`); this module sits above both the listing
(:mod:`~tierpoint.dcp.step_dirs`) and the peer transfers (:mod:`~tierpoint.dcp.peer_fetch`), which do
not import each other.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .. import dist as tpdist
from .. import storage
from .peer_fetch import retrieve_missing
from .step_dirs import complete_dirs, decider, gather_views, warn_skipped


def get_latest_complete_checkpoint(
    base: str | os.PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
    group: Any = None,
    node_local: bool = False,
    all_files: bool = False,
) -> str | None:
    """The path of the newest complete step directory under ``base`` (``step-<N>``, or ML
    Flashpoint's ``step-<N>_ckpt``), the same on every rank (else
    ``None``).

    Collective when ``torch.distributed`` is initialised: every rank of ``group`` (default:
    tierpoint's coordination group) must call it. Without ``torch.distributed`` it decides alone.

    ``node_local=True``: ``base`` is a directory on each node's own disk. Candidates are tried newest
    first; for each, the files this node's ranks need and lack are fetched from the peers that
    hold them (:mod:`tierpoint.dcp.peer_fetch`); a candidate with a file that exists nowhere is
    skipped. The returned step is then loadable from ``base`` on every node, in the layout it was
    saved in (at the same world size, a node gets the files its own ranks wrote and those every rank
    reads) or at any other world size. ``all_files=True``: every node gets every data file, for a
    load in another layout at the same world size (another parallelism, FSDP to DDP).
    """
    base = storage.checkpoint_path(base, "base")
    if node_local:
        return _latest_node_local(base, storage_options, group, all_files)
    views = gather_views(base, storage_options, group)
    decision = None
    if tpdist.get_rank() == decider(group):
        decision = next(iter(complete_dirs([v["view"] for v in views])), None)
        warn_skipped(views, decision)
    name = tpdist.broadcast_json(
        decision, decider(group), f"agreeing on the latest checkpoint under {base}", group=group
    )
    return None if name is None else storage.join(base, str(name))


def _latest_node_local(
    base: str | os.PathLike, storage_options: Mapping[str, Any] | None, group: Any, all_files: bool
) -> str | None:
    if not storage.is_local(base):
        raise ValueError(f"node_local needs a local directory, got {base}")
    views = gather_views(base, storage_options, group)
    # Every rank holds every view, so every rank walks the same candidates in the same order.
    found = None
    alone = not tpdist.is_distributed()  # one process: no peer to fetch from
    for name in complete_dirs([v["view"] for v in views]):
        if alone or retrieve_missing(storage.join(base, name), all_files=all_files):
            found = name
            break
    if tpdist.get_rank() == decider(group):
        warn_skipped(views, found)
    return None if found is None else storage.join(base, found)
