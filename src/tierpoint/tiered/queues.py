"""One :class:`~tierpoint.asyncsave.AsyncCallsQueue` per tier of a
:class:`~tierpoint.TieredCheckpointManager`, each with its own worker process.

One worker runs its calls one at a time: with one queue for both tiers, a local save scheduled
after a persistent upload waited for the upload's end, and so did the training thread at the next
local save (seconds on a slow store, for a save of a few tens of milliseconds). Each tier's saves
now run in their own worker: a local save never waits behind a persistent one.

A tier's queue (and so its worker, a process that imports torch: seconds of CPU) is made when the
tier is first used, or by :meth:`start` (the manager's warm-up, steps ahead of the first save): a
manager that only restores starts no process. A first save without a warm-up does not wait for
the worker's start either (its call waits in the pipe), only its time to durable does.

Call order: ``TierQueues(tiers, ...)`` in the manager's constructor; :meth:`start` at the warm-up;
``queues[tier].schedule_async_request(...)``; :meth:`finalize` (polls and waits); :meth:`hook`
with ``overlap_snapshot``; :meth:`close` once.

Invariants: the queues are made and finalized in one order on every rank (made where every rank
makes them: at a save or the warm-up; finalized in ``tiers`` order), so the collectives of their
finalize functions meet; a failed save is a WARNING here (its record says which save), never the
end of a wait: the calls after it are waited for too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from .. import dist as tpdist
from ..asyncsave import AsyncCallsQueue
from ..errors import CheckpointingError

logger = logging.getLogger("tierpoint")


class TierQueues:
    """The queues of the tiers in use, by tier name (see the module docstring)."""

    def __init__(self, tiers: Iterable[str], timeout: float | None, overlap_snapshot: bool) -> None:
        self.tiers = tuple(tiers)
        self.timeout = tpdist.timeout_or(timeout, tpdist.default_timeout().total_seconds())
        self.overlap_snapshot = overlap_snapshot
        self._made: dict[str, AsyncCallsQueue] = {}
        self._hooks: dict[tuple[int, str], Any] = {}  # (optimizer, tier) -> hook

    def __getitem__(self, tier: str) -> AsyncCallsQueue:
        """``tier``'s queue, made on first use."""
        queue = self._made.get(tier)
        if queue is None:
            queue = AsyncCallsQueue(timeout=self.timeout, overlap_snapshot=self.overlap_snapshot)
            if tier == "persistent":  # the worker's first persistent save needs them
                queue.preload("tierpoint.dcp.writer", "tierpoint.dcp.checksums")
            self._made[tier] = queue
        return queue

    @property
    def by_tier(self) -> dict[str, AsyncCallsQueue]:
        """The queues made so far, in ``tiers`` order."""
        return {tier: self._made[tier] for tier in self.tiers if tier in self._made}

    def start(self) -> None:
        """Make every tier's queue (its worker starts in the background)."""
        for tier in self.tiers:
            self[tier]

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
                hook = self[tier].install_optimizer_hook(optimizer)
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
