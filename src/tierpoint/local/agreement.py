"""Before a local save writes anything: every rank agrees on the iteration and on what to keep.

Call order: :meth:`tierpoint.local.saving.PartSaver.save` calls :func:`agree_on_iteration`
(collective) first. When every rank's committed parts are as its last commit left them, one
all-reduce of a few integers decides (O(1) bytes per rank); otherwise every rank's listing is
gathered and the complete iterations are computed from them.

Invariants: every rank returns the same set of complete iterations to keep and the same save token
(rank 0's: it tells this save's parts from another save's of the same iteration; its text, ``t``
and 16 hex digits, is rank 0's clock in milliseconds then 20 random bits, so a later save's sorts
after an earlier one's, and after the random 16 hex digits that tokens were before), or raises the same
:class:`CheckpointingError` (a rank refused its arguments; ranks disagree on the iteration, ``keep_last`` or the session; it is not newer than every complete,
loadable iteration or than an async save still in flight). ``keep_last`` counts the new iteration.
Nothing is written, except this rank's directory is created.
"""

from __future__ import annotations

import json
import logging
import random
import time
import zlib
from collections.abc import Iterable
from typing import Any

from .. import dist as tpdist
from ..errors import CheckpointingError
from . import naming
from .store import Listing, PartStore, complete_iterations

logger = logging.getLogger("tierpoint")

_NO_TOKEN = 1 << 62  # what ranks other than 0 offer (the MIN takes rank 0's token, below it)

AfterCommit = tuple[frozenset[int], Listing]
"""What a rank knew after its last commit: the complete iterations then kept, and its sorted
listing (:meth:`PartStore.scan`)."""


def agree_on_iteration(
    store: PartStore,
    iteration: int,
    *,
    keep_last: int,
    in_flight: int,
    after_commit: AfterCommit | None,
    refusal: CheckpointingError | None = None,
) -> tuple[set[int], str]:
    """Check (on every rank alike) that all ranks save the same, new ``iteration``; return the
    complete iterations to keep besides it and the save's token. Collective.

    ``in_flight``: the newest async save this rank requested and that is not finalized (-1: none);
    ``after_commit``: what this rank knew after its last commit (``None``: nothing, listings are
    gathered); ``refusal``: why this rank does not save (an argument it refused): every rank
    raises it, with the listings gathered (the all-reduce of an unchanged tier says "changed").
    """
    # Collective at its first call only: the commit retires the directories left behind on a
    # node once the node layout is known (tierpoint.local.left_behind), also without find_latest.
    tpdist.node_layout("save: gathering node ids")
    offer = _new_token() if store.rank == 0 else _NO_TOKEN
    known = after_commit if refusal is None else None
    agreed = _agree_unchanged(store, iteration, keep_last, in_flight, known, offer)
    if agreed is not None:
        return agreed
    gathered = _gather_parts(
        store,
        "save: agreeing on the iteration",
        {
            "iteration": iteration,
            "requested": in_flight,
            "unloadable": sorted(store.unloadable),
            "token": offer,
            "keep_last": keep_last,
            "session_id": store.session_id,
        },
        refusal,
    )
    requested = [g["iteration"] for g in gathered]
    if len(set(requested)) != 1:
        raise CheckpointingError(
            f"ranks disagree on the iteration to save: {dict(enumerate(requested))}"
        )
    for key, what in (
        ("keep_last", "keep different numbers of local checkpoints"),  # (would retire others)
        ("session_id", "save into different sessions"),  # (a restore would find no iteration)
    ):
        values = [g[key] for g in gathered]
        if len(set(values)) != 1:
            raise CheckpointingError(
                f"ranks {what} ({key}): {dict(enumerate(values))}; every rank must use the same"
            )
    unloadable = {i for g in gathered for i in g["unloadable"]}
    complete = {
        i: world
        for i, world in complete_iterations([g["parts"] for g in gathered]).items()
        if world == store.world_size and i not in unloadable
    }
    in_flight = max(g["requested"] for g in gathered)
    keep = keep_for(iteration, complete, in_flight, keep_last)
    listed = {p[0] for g in gathered for p in g["parts"]} - {in_flight}  # (committed since: kept)
    superseded = sorted(i for i in listed if i >= iteration or i not in complete)
    if superseded and store.rank == 0:
        logger.warning(
            "saving local iteration %d removes iteration(s) %s, which this job cannot load "
            "(saved with another world size, incomplete, or without a good copy of some part)",
            iteration,
            ", ".join(map(str, superseded)),
        )
    return keep, _token_text(gathered[0]["token"])


def _new_token() -> int:
    """Milliseconds since the epoch, then 20 random bits (below ``_NO_TOKEN`` until 2109)."""
    ms = time.time_ns() // 1_000_000
    return ((ms << 20) | random.SystemRandom().getrandbits(20)) % _NO_TOKEN


def _token_text(value: int) -> str:
    """``t`` then 16 hex digits: sorts after every token of before time-ordered ones (16 hex
    digits, random), so a save made since is taken as newer than one made before."""
    return f"t{value:016x}"


def keep_for(iteration: int, complete: Iterable[int], in_flight: int, keep_last: int) -> set[int]:
    """The complete iterations to keep when saving ``iteration`` (``keep_last`` counts it);
    refuses an iteration that is not newer than every complete one and than ``in_flight``
    (the newest async save requested on any rank and not finalized)."""
    latest = max(complete, default=naming.NO_CHECKPOINT)
    if iteration <= latest:
        raise CheckpointingError(
            f"cannot save iteration {iteration}: iteration {latest} is already saved and "
            "iterations must increase (if no run of this job saved it, another job saves under "
            "the same local root and session_id: give each job its own session_id)"
        )
    if iteration <= in_flight:
        raise CheckpointingError(
            f"cannot save iteration {iteration}: an async save of iteration {in_flight} was "
            "requested and is not finalized; iterations must increase"
        )
    older = sorted((i for i in complete if i < iteration), reverse=True)
    return set(older[: keep_last - 1])


def _agree_unchanged(
    store: PartStore,
    iteration: int,
    keep_last: int,
    in_flight: int,
    known: AfterCommit | None,
    offer: int,
) -> tuple[set[int], str] | None:
    """What to keep when saving ``iteration``, agreed by one all-reduce (O(1) bytes per rank),
    if every rank's committed parts are as its last commit left them (``known``) and every rank
    knows the same complete iterations and keeps as many; ``None`` (listings must be gathered) otherwise, on every
    rank.

    The all-reduce also carries the requested iteration (equal on every rank), the newest
    async save still in flight, so the same refusals as with gathered listings follow, and the
    token rank 0 offers."""
    unchanged = known is not None and not store.unloadable
    if unchanged:
        try:
            store.ensure_dir()
            unchanged = sorted(store.scan()) == known[1]
        except (OSError, CheckpointingError):
            unchanged = False  # the gathered path reports it
    complete = sorted(known[0]) if known is not None and unchanged else []
    digest = zlib.crc32(json.dumps([complete, keep_last, store.session_id]).encode()) & 0x7FFFFFFF
    low = tpdist.reduce_ints(
        [unchanged, iteration, -iteration, digest, -digest, -in_flight, offer],
        "min",
        "save: agreeing on the iteration",
    )
    if not (low[0] == 1 and low[1] == -low[2] and low[3] == -low[4]):
        return None
    return keep_for(iteration, complete, -low[5], keep_last), _token_text(low[6])


def _gather_parts(
    store: PartStore, what: str, payload: dict[str, Any], refusal: CheckpointingError | None = None
) -> list[Any]:
    """Every rank's ``payload`` with its committed parts (``"parts"``, see :meth:`PartStore.scan`);
    a rank that refused (``refusal``) or cannot create or list its directory makes every rank raise."""
    error: Exception | None = refusal
    parts: list[Any] = []
    try:
        if error is None:
            store.ensure_dir()
            parts = store.scan()
    except (OSError, CheckpointingError) as e:
        error = e
    gathered = tpdist.all_gather_json(
        {**payload, "parts": parts, "error": tpdist.failure_status(error)}, what
    )
    tpdist.raise_failures(what, [g["error"] for g in gathered], error)
    return gathered
