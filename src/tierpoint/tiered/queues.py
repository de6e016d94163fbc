"""One :class:`~tierpoint.asyncsave.AsyncCallsQueue` per tier of a
:class:`~tierpoint.TieredCheckpointManager`, each with its own worker process.

One worker runs its calls one at a time: with one queue for both tiers, a local save scheduled
after a persistent upload waited for the upload's end, and so did the training thread at the next
local save (seconds on a slow store, for a save of a few tens of milliseconds). Each tier's saves
now run in their own worker: a local save never waits behind a persistent one.

Call order: ``TierQueues(tiers, ...)`` in the manager's constructor (every rank, in one order: each
queue makes its gloo group); ``queues[tier].schedule_async_request(...)``; :meth:`finalize` (polls
and waits); :meth:`hook` with ``overlap_snapshot``; :meth:`close` once.

Invariants: the queues are finalized in one order (:data:`~tierpoint.tiered.manager.TIERS`) on every
rank, so the collectives of their finalize functions meet; a failed save is a WARNING here (its
record says which save), never the end of a wait: the calls after it are waited for too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ..asyncsave import AsyncCallsQueue
from ..errors import CheckpointingError

logger = logging.getLogger("tierpoint")


class TierQueues:
    """The queues of the tiers in use, by tier name (see the module docstring)."""

    def __init__(self, tiers: Iterable[str], timeout: float | None, overlap_snapshot: bool) -> None:
        self.by_tier = {
            tier: AsyncCallsQueue(timeout=timeout, overlap_snapshot=overlap_snapshot)
            for tier in tiers
        }
        self.overlap_snapshot = overlap_snapshot
        self._hooks: dict[tuple[int, str], Any] = {}  # (optimizer, tier) -> hook

    def __getitem__(self, tier: str) -> AsyncCallsQueue:
        return self.by_tier[tier]

    @property
    def timeout(self) -> float:
        return min(queue.timeout for queue in self.by_tier.values())

    def pending(self) -> int:
        """Calls scheduled and not finalized, over every tier."""
        return sum(queue.get_num_unfinalized_calls() for queue in self.by_tier.values())

    def hook(self, tier: str, optimizers: Iterable[Any]) -> None:
        """With ``overlap_snapshot``: make each optimizer's step wait for the snapshot in flight
        of ``tier``'s queue (once per optimizer and tier), ahead of its first snapshot of them."""
        if not self.overlap_snapshot:
            return
        for optimizer in optimizers:
            if (id(optimizer), tier) not in self._hooks:
                hook = self.by_tier[tier].install_optimizer_hook(optimizer)
                self._hooks[id(optimizer), tier] = hook

    def wait_for_snapshot(self, timeout: float | None = None) -> None:
        for queue in self.by_tier.values():
            queue.wait_for_snapshot(timeout)

    def finalize(self, blocking: bool, tier: str | None = None, through: int | None = None) -> None:
        """Finalize what finished (collective), in every queue or ``tier``'s; ``blocking``: wait
        for all of it, or with ``through`` for ``tier``'s calls up to that one."""
        for name, queue in self.by_tier.items():
            if tier is None or name == tier:
                _finalize(queue, blocking, through)

    def close(self, abort: bool) -> None:
        """Remove the optimizer hooks and close every queue; after one raised (an interrupted
        wait), the others are closed with ``abort=True``, then its error is raised."""
        for hook in self._hooks.values():
            hook.remove()
        self._hooks.clear()
        error: BaseException | None = None
        for queue in self.by_tier.values():
            try:
                queue.close(abort=abort or error is not None)
            except BaseException as e:  # noqa: BLE001 - raised below, once every queue is closed
                error = error or e
        if error is not None:
            raise error


def _finalize(queue: AsyncCallsQueue, blocking: bool, through: int | None) -> None:
    while True:
        try:
            if through is None:
                queue.maybe_finalize_async_calls(blocking=blocking)
            else:
                queue.finalize_through(through)
            return
        except CheckpointingError as e:  # its record says which save; training goes on
            logger.warning("a checkpoint save failed: %s", e)
        if not blocking or not queue.get_num_unfinalized_calls():
            return
