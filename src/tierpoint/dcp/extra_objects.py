"""Files kept beside a DCP checkpoint on node-local disks (NeMo's ``context/``, say), brought to
every node that lacks them: what ML Flashpoint's loader hooks ``_get_extra_local_objects`` and
``_get_extra_needed_objects`` ask for (:mod:`tierpoint.dcp.flashpoint` calls this).

Call order: every rank calls :func:`retrieve_extra_objects` for the same step (the path on its own
node), once its DCP files were found complete. Each rank lists the step directory plus the extra
files its ``local`` hook names; the listings are gathered; rank 0 calls the ``needed`` hook and
plans, for each needed file a node lacks, a copy from the lowest rank of another node holding it
into the node's lowest rank; the plan is broadcast and carried out (:func:`fetch_from_peers`:
see :mod:`.peer_fetch`).

Invariants: files are matched by their name inside the step directory (its path may differ from
node to node; a path is compared normalized, as pathlib spells it, ``file://`` removed); a name
outside it (absolute elsewhere, or with ``..``) is refused; a hook's or a
transfer's failure raises the same error on every rank; every wait is bounded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .. import dist as tpdist
from .. import peers, storage
from ..errors import CheckpointingError
from .peer_fetch import fetch_from_peers

logger = logging.getLogger("tierpoint")

LocalHook = Callable[[Path], Iterable[str]]
"""This rank's extra files in the step directory: paths, or names relative to it."""
NeededHook = Callable[[dict[int, list[str]]], Iterable[str]]
"""Given each rank's files (rank 0's paths), the extra files every node needs."""


def retrieve_extra_objects(step_dir: str, local: LocalHook, needed: NeededHook) -> None:
    """Bring the extra files ``needed`` names to every node lacking them (see the module
    docstring). Collective."""
    names: list[str] | None = None
    error: BaseException | None = None
    try:
        path = storage.local_path(step_dir)
        listed = os.listdir(path) if os.path.isdir(path) else []
        names = sorted({name_in(step_dir, o) for o in [*listed, *local(Path(path))]})
    except Exception as e:  # noqa: BLE001 - shared with every rank below
        error = e
    what = f"listing the extra objects of {step_dir}"
    tpdist.raise_if_any_failed(what, error)
    views: list[dict[str, Any]] = tpdist.all_gather_json({"dir": step_dir, "names": names}, what)
    layout = tpdist.node_layout()
    plan: list[list[Any]] | None = None
    error = None
    if tpdist.get_rank() == 0:
        try:
            held = [v["names"] for v in views]
            files = {r: [storage.join(step_dir, n) for n in held[r]] for r in range(len(held))}
            wanted = {name_in(step_dir, o) for o in needed(files)}
            plan = plan_extra_moves(wanted, held, layout)
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            error = e
    tpdist.raise_if_any_failed(f"planning the extra objects of {step_dir}", error)
    plan = tpdist.broadcast_json(plan, what=f"the extra objects of {step_dir}")
    moves = [
        peers.FileMove(
            src, dst, storage.join(views[src]["dir"], name), storage.join(views[dst]["dir"], name)
        )
        for src, dst, name in plan
    ]
    if moves:
        fetch_from_peers(moves, f"retrieving the extra objects of {step_dir}")


def name_in(step_dir: str, location: str) -> str:
    """``location`` (a path inside ``step_dir``, or a name relative to it) as its name relative to
    ``step_dir``; raises :class:`CheckpointingError` for one outside it."""
    step = os.path.normpath(storage.local_path(step_dir))
    path = storage.local_path(location)
    if ".." in path.split("/"):
        raise CheckpointingError(f"extra checkpoint object {location} is not inside {step_dir}")
    path = os.path.normpath(path)  # (a hook's pathlib.Path drops "./" and doubled slashes)
    if os.path.isabs(path) != os.path.isabs(step) and os.path.isabs(path):
        path = os.path.relpath(path)  # (absolute from a relative step: compared from here)
    if path.startswith(step.rstrip("/") + "/"):
        path = path[len(step.rstrip("/")) + 1 :]
    if os.path.isabs(path) or path in (".", step) or path.startswith("../"):
        raise CheckpointingError(f"extra checkpoint object {location} is not inside {step_dir}")
    return path


def plan_extra_moves(
    needed: set[str], held: list[list[str]], layout: tpdist.NodeLayout
) -> list[list[Any]]:
    """``[source rank, node leader, name]`` for each needed file a node lacks, from the lowest
    rank of another node holding it (a file no node holds is left out, with a WARNING)."""
    holders: dict[str, list[int]] = {}
    for rank, names in enumerate(held):
        for name in names:
            holders.setdefault(name, []).append(rank)
    plan: list[list[Any]] = []
    for name in sorted(needed):
        sources = holders.get(name, [])
        if not sources:
            logger.warning("extra checkpoint object %s is on no node: not retrieved", name)
            continue
        for node in layout.nodes:
            ranks = [r for r, n in enumerate(layout.node_of_rank) if n == node]
            if not any(r in ranks for r in sources):
                plan.append([sources[0], ranks[0], name])
    return plan
