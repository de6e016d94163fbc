"""A save's replication step: this rank's part sent to its clique and the clique's parts received,
or the replicas a user's strategy hands this rank written as part files.

Call order: :class:`~tierpoint.local.saving.PartSaver` calls :func:`replicate_part` (collective
over the clique's group: in the training process for a sync save, in the background for an async
one) after the part is written, or :func:`write_user_replicas` (NVRx's ``replicate``, collective,
in the training process) before a save commits.

Invariants: a replica arrives verified and under its final name, or not at all
(:meth:`~tierpoint.local.store.PartStore.move_parts`); a rank whose own write failed says so to
its peers at once (``written`` False) instead of making them wait; a user strategy's replica of
another iteration, session or rank than the one being saved is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .. import fileformat, peers
from ..errors import CheckpointingError
from ..tensor_aware import TensorAwareStateDict
from .naming import CkptID
from .replication import UserReplication
from .store import PartStore

logger = logging.getLogger("tierpoint")


def replicate_part(
    store: PartStore, replication: Any, iteration: int, written: bool, recycle: bool
) -> peers.MoveStats | None:
    """Send this rank's part of ``iteration`` to its clique and receive the clique's parts
    (collective); ``written`` False: this rank's own write failed, its peers learn it at once.
    ``recycle``: received parts reuse spare files. None without replication."""
    if replication is None or replication.replication_factor < 2:
        return None
    start = time.perf_counter()
    moves = store.part_moves(
        iteration,
        [(o, h, o) for o in range(store.world_size) for h in replication.holders(o)],
    )
    stats = store.move_parts(
        moves,
        replication.group,
        unavailable=None if written else f"rank {store.rank} could not write its own part",
        reuse=lambda move: store.take_spare(leftovers=False) if recycle else None,
    )
    logger.debug(
        "replicated iteration %d: sent %d, received %d bytes in %.3f s",
        iteration,
        stats.sent_bytes,
        stats.received_bytes,
        time.perf_counter() - start,
    )
    return stats


def write_user_replicas(
    store: PartStore,
    replication: UserReplication,
    state: TensorAwareStateDict,
    iteration: int,
    extra_of: Callable[[int], dict[str, Any]],
) -> None:
    """Run the user's ``replicate`` (collective) and write what it gives this rank to keep as
    replica parts (``extra_of(iteration)``: the metadata a part of this rank carries)."""
    ckpt_id = CkptID(iteration, store.rank, store.session_id)
    for ckpt, (saved, origin, session) in replication.replicate(state, ckpt_id):
        if origin == store.rank:
            continue
        if (
            saved != iteration
            or session != store.session_id
            or type(origin) is not int
            or not 0 <= origin < store.world_size
        ):
            raise CheckpointingError(
                f"{type(replication.strategy).__name__}.replicate returned a checkpoint "
                f"of {(saved, origin, session)} while saving {ckpt_id}"
            )
        flat = ckpt.to_flat()
        extra = {**extra_of(iteration), "rank": origin}
        path = store.part_path(iteration, origin)
        fileformat.write_flat(path, flat, plan=fileformat.plan_part(flat, extra))
