"""TieredCheckpointManager: one object over every tier, saving by schedule and restoring the newest
checkpoint that is complete anywhere.

Call order (every rank, at the same points of the training loop)::

    manager = TieredCheckpointManager(local_dir, persistent_dir, "job", local_every=10,
                                      persistent_every=100)
    step = manager.restore(state)            # None when nothing exists anywhere
    for step in range((step or 0) + 1, total + 1):
        train_step()
        manager.maybe_save(step, state)      # returns after the snapshot; saves by schedule
                                             # (its first call not due warms the tiers up)
    manager.close()                          # waits for what is in flight

The parts it composes: the local tier (:class:`~tierpoint.local.LocalCheckpointManager`, with clique
replication across nodes), the persistent tier (:mod:`tierpoint.dcp`, torch DCP files on a shared
path or an object store), one :class:`~tierpoint.asyncsave.AsyncCallsQueue` per tier
(:mod:`.queues`: each with its worker process, so a local save never waits behind a persistent
upload), :mod:`.state` (stateful members taken apart and put back in place), :mod:`.retention`
and :mod:`.events`. This module holds the configuration, the schedule and the
checks of every call; the save path (each tier's save, the persistent copy from the local part,
the final save) is :mod:`.saving` (a mixin of the manager), the restore path across tiers
:mod:`.restoring`.

Restore order: the newest complete step of the local tier (parts fetched from peer replicas where a
node lost its own) if it is at least as new as the newest complete persistent step, else the
persistent steps newest first, the local step before any older than it; a step that cannot be
loaded on every rank (missing everywhere, failing verification) is skipped with its reason,
logged and kept in ``last_restore``. Every rank
gets the same answer: each decision is agreed.

Saving: a step due for both tiers is snapshotted once, into the local tier; its persistent copy is
made from the local part's bytes once the local save is committed on every rank (so never from a
training state that has moved on; the worker writes them from the held part, the training thread
copies nothing, see :mod:`.saving`), except for DTensor states, whose persistent copy needs the
global layout and is snapshotted from the state at the same step. A persistent save that fails
(an unreachable store) is reported (WARNING, a failed record) and training and local saves go on;
the next persistent save tries again.

Invariants: at most two calls in flight (a local and a persistent save; a third waits for the
oldest); the persistent tier keeps ``keep_persistent`` complete steps and removes an older one only
after a newer one is committed (:mod:`.retention`); a restore that finds a different state
structure raises :class:`StateMismatchError` on every rank before anything is copied; a state
refused on one rank (not a dict, a ``state_dict()`` that raises) fails that save or restore on
every rank at once, in its first agreement.
"""

from __future__ import annotations

import logging
import signal as signals
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import dcp, storage
from .. import dist as tpdist
from ..errors import CheckpointingError, check_flag, ends_cleanly
from ..local import CliqueReplicationStrategy, LocalCheckpointManager
from . import state as st
from .events import EventLog, RestoreRecord
from .queues import TierQueues
from .replicas import ReplicaCheck
from .restoring import owed_copy, reset, restore_newest
from .saving import SavePath, _Deferred
from .steps import checked_step, refuse_going_back

logger = logging.getLogger("tierpoint")

TIERS = ("local", "persistent")


class TieredCheckpointManager(SavePath):
    """Saves to the node-local and persistent tiers by schedule and restores from whichever holds
    the newest complete checkpoint (see the module docstring).

    Args:
        local_dir: node-local root (default ``/dev/shm/tierpoint-<uid>``).
        persistent_dir: shared path or fsspec URL (``s3://...``); ``None``: local tier only.
        session_id: separates jobs sharing a local root.
        local_every / persistent_every: save every N steps to that tier (0: never).
        replication_factor: copies of each local part, counting the original, kept on other nodes
            (1: none; where the nodes cannot hold the copies, such as fewer nodes than copies or
            3 nodes for 2 copies, replication is off and a WARNING says so).
        replication_jump: distance between ranks holding copies (default: ranks per node).
        keep_local / keep_persistent: newest complete checkpoints kept in each tier.
        storage_options: fsspec options for ``persistent_dir`` (endpoint, credentials).
        on_event: called with a dict for every save and restore (see :mod:`.events`).
        timeout: seconds the manager's queues wait for a save to finish (default
            ``TIERPOINT_TIMEOUT`` or 300). tierpoint's collectives (one gloo group every tierpoint
            object of the process shares) wait up to ``TIERPOINT_TIMEOUT``: set that variable to
            bound how long a rank waits for a stopped or departed peer.
        poll_every: ``maybe_save`` finalizes finished saves every N steps (and whenever a save is
            due). While a save is in flight each poll is one small all-reduce, so polling every step
            costs training time; default: half the shortest save interval.
        overlap_snapshot: copy each snapshot on a background thread while the next steps' forward
            and backward passes run (on GPUs: into pinned memory, at the PCIe rate); each optimizer
            in the state waits for it before its step changes a parameter. Code that changes the
            state's tensors in place otherwise (a forward pass updating batch-norm statistics)
            calls :meth:`wait_for_snapshot` first, or leaves this off.
        device_snapshot: each local save first copies the state within its devices' memory (on
            GPUs: in the training stream's order, a few milliseconds for 4 GB on an H100), so the
            state is free as soon as ``maybe_save`` returns and the optimizers' hooks wait for
            nothing (a step saved to the persistent tier alone is still copied as
            ``overlap_snapshot`` says); costs as much memory on each device as the state holds
            there (see
            :class:`~tierpoint.local.LocalCheckpointManager`).

    Collective: construction (every rank given the same settings but ``local_dir``, ``timeout``,
    ``storage_options`` and ``on_event``, else every rank raises; node layout), ``restore``, ``maybe_save``, ``save``, ``wait``,
    ``final_save`` and ``close`` are called by every rank at the same point.
    """

    def __init__(
        self,
        local_dir: str | None = None,
        persistent_dir: str | None = None,
        session_id: str = "",
        *,
        local_every: int = 10,
        persistent_every: int = 100,
        replication_factor: int = 2,
        replication_jump: int | None = None,
        keep_local: int = 2,
        keep_persistent: int = 3,
        storage_options: Mapping[str, Any] | None = None,
        on_event: Callable[[dict[str, Any]], Any] | None = None,
        timeout: float | None = None,
        poll_every: int | None = None,
        overlap_snapshot: bool = False,
        device_snapshot: bool = False,
    ) -> None:
        what = "creating a TieredCheckpointManager"  # (before the checks: one rank alone raised)
        tpdist.agree_on_settings(
            what,
            {
                "session_id": session_id,
                "local_every": local_every,
                "persistent_every": persistent_every,
                "persistent_dir": persistent_dir if persistent_every else None,
                "replication_factor": replication_factor,
                "replication_jump": replication_jump,
                "keep_local": keep_local,
                "keep_persistent": keep_persistent,
                "poll_every": poll_every,
                "overlap_snapshot": overlap_snapshot,
                "device_snapshot": device_snapshot,
            },
        )
        for name, value, low in (
            ("local_every", local_every, 0),
            ("persistent_every", persistent_every, 0),
            ("replication_factor", replication_factor, 1),
            ("keep_local", keep_local, 1),
            ("keep_persistent", keep_persistent, 1),
            ("replication_jump", 1 if replication_jump is None else replication_jump, 1),
        ):  # (all before any collective: a job of one node checks its replication_jump too)
            if type(value) is not int or value < low:
                raise CheckpointingError(f"{name} must be an integer >= {low}, got {value!r}")
        check_flag("overlap_snapshot", overlap_snapshot)
        check_flag("device_snapshot", device_snapshot)
        if persistent_dir is None and persistent_every:
            persistent_every = 0
        if not local_every and not persistent_every:
            raise CheckpointingError(
                "nothing to save to: local_every is 0 and there is no persistent tier "
                "(give persistent_dir and persistent_every > 0, or local_every > 0)"
            )
        if not tpdist.is_distributed():
            tpdist.refuse_uninitialised_launch()
        shortest = min(e for e in (local_every, persistent_every) if e)
        if poll_every is not None and (type(poll_every) is not int or poll_every < 1):
            raise CheckpointingError(f"poll_every must be an integer >= 1, got {poll_every!r}")
        self.poll_every = poll_every or max(1, shortest // 2)
        self.local_every = local_every
        self.persistent_every = persistent_every
        self.keep_persistent = keep_persistent
        self.storage_options = storage.options_dict(storage_options)
        self.persistent_dir = (
            storage.checkpoint_path(persistent_dir, "persistent_dir") if persistent_every else None
        )
        self.local: LocalCheckpointManager | None = None
        if local_every:
            self.local = LocalCheckpointManager(
                local_dir,
                session_id,
                CliqueReplicationStrategy.for_job(replication_factor, replication_jump),
                keep_last=keep_local,
                device_snapshot=device_snapshot,
            )
        in_use = {"local": self.local is not None, "persistent": self.persistent_dir is not None}
        self.queues = TierQueues([t for t in TIERS if in_use[t]], timeout, overlap_snapshot)
        self._staging_pool = dcp.StagingPool()  # the persistent saves' staging memory
        self.last_restore: RestoreRecord | None = None
        """What the last :meth:`restore` did (step, tier, seconds, bytes, skipped steps)."""
        self._events = EventLog(on_event)
        self._last_step: int | None = None
        self._deferred: _Deferred | None = None
        self._in_flight: dict[str, int] = {}  # tier -> call id of its save not yet finalized
        self._retiring = None
        self._aborting = False
        self._retire_next = None
        self._retire_lock = threading.Lock()
        self._retention_started = False
        self._local_failing = False
        self._persistent_owed: int | None = None
        self._replica_check = ReplicaCheck()
        self._signalled = False
        self._watching_signal = False
        self._closed = False
        self._warmed_up = False  # the warm-up started (at the first step not saved)
        self._looked_ahead = self.persistent_dir is None  # (see steps.refuse_going_back)

    # ------------------------------------------------------------------------------ saving

    def due(self, step: int) -> tuple[str, ...]:
        """The tiers the schedule saves ``step`` to."""
        return tuple(
            tier
            for tier, every in (("local", self.local_every), ("persistent", self.persistent_every))
            if every and step % every == 0
        )

    def maybe_save(self, step: int, state: Mapping[str, Any]) -> tuple[str, ...]:
        """Finalize what finished, then save ``step`` to the tiers the schedule says; returns them.

        After :meth:`install_signal_handler`'s signal: writes a final persistent checkpoint of
        ``step`` instead, closes the manager and exits the process with status 0.
        """
        self._refuse_if_closed()
        step = self._check_step(step)
        tiers = self.due(step)
        if step % self.poll_every == 0 or tiers:
            self.poll()
        tiers = self._with_owed_copy(step, tiers)
        if self._watching_signal and self._agree_on_signal():
            self.final_save(state, step)
            self.close()
            logger.warning("stopping after the final checkpoint of step %d (signal received)", step)
            sys.exit(0)
        if tiers:
            self.save(step, state, tiers)
        elif not self._warmed_up:
            # The first call after training started: the state has its layout (the optimizer's
            # state exists), and the first save is steps away.
            self._warmed_up = True
            self._warm_up(step, state)
        return tiers

    def save(self, step: int, state: Mapping[str, Any], tiers: str | Iterable[str] = TIERS) -> None:
        """Save ``step`` to ``tiers`` now, asynchronously (returns after the snapshot)."""
        self._refuse_if_closed()
        step = self._check_step(step, saving=True)
        wanted = (tiers,) if isinstance(tiers, str) else tuple(tiers)
        bad = [t for t in wanted if t not in TIERS]
        if bad or not wanted:
            raise CheckpointingError(f"tiers must name 'local' and/or 'persistent', got {tiers!r}")
        wanted = tuple(
            t
            for t in TIERS
            if t in wanted and (self.local if t == "local" else self.persistent_dir)
        )
        # A state refused (here, on any rank, or by the local save): raised on every rank by the
        # save's first agreement, and the step stays free.
        tree, refusal = st.template_or_refusal(state)
        if "local" not in wanted:  # the local tier's save agrees on the step itself
            self._agree_on_step(step, refusal)
        optimizers = [] if refusal else st.optimizers(state)  # (hooked before their snapshot)
        rank_local = [k for k, v in tree.items() if isinstance(v, st.RankLocal)]
        sharded = st.has_dtensor(tree)
        if "local" in wanted:
            self.queues.hook("local", optimizers)
            # The previous local save is committed first; its persistent copy (if due) starts now.
            self._make_room("local")
            self._start_deferred()
            self._save_local(step, tree, refusal)
        self._last_step = step
        if "persistent" in wanted:
            if "local" in wanted and not sharded and not self._local_failing:
                self._deferred = _Deferred(step, rank_local)
            else:
                self.queues.hook("persistent", optimizers)
                self._save_persistent(step, st.persistent_form(tree, tpdist.get_rank()))
            self._persistent_owed = None  # a copy lost meanwhile is made up for by this one

    def final_save(self, state: Mapping[str, Any], step: int) -> None:
        """Write a synchronous checkpoint of ``step``: to the persistent tier (the local tier
        without one). For the end of training or a preemption; returns once it is committed."""
        self._refuse_if_closed()
        self.wait()
        step = self._check_step(step, saving=True, final=True)
        tree, refusal = st.template_or_refusal(state)
        self._agree_on_step(step, refusal)
        self._last_step = step
        self._save_final(step, tree)

    # ------------------------------------------------------------------------------ restoring

    def restore(self, state: dict[str, Any]) -> int | None:
        """Load the newest checkpoint complete anywhere into ``state`` in place; return its step
        (``None``, state untouched, when there is none). Collective; the same answer on every rank.
        Raises :class:`CheckpointingError` when checkpoints exist but none can be loaded (or a tier
        cannot be listed): a run started over would save over them.
        """
        self._refuse_if_closed()
        self.wait()
        start = time.perf_counter()
        fresh: list[Any] = []
        try:
            with tpdist.agree("taking the state apart to restore it"):  # a refusal: on every rank
                fresh = st.init_optimizers(state)
                tree = st.template(state)
            record, newest_persistent = restore_newest(
                state, tree, self.local, self.persistent_dir, self.storage_options, start
            )
        except BaseException:
            reset(fresh)
            raise
        self._looked_ahead = True  # (newer persistent steps failed to load: no going back)
        if record.step is None:
            reset(fresh)
        else:
            self._last_step = record.step
            self._persistent_owed = owed_copy(record, newest_persistent, self.persistent_every)
        self.last_restore = record
        self._events.emit(record)
        return record.step

    # ------------------------------------------------------------------------------ the rest

    def install_signal_handler(self, signum: int = signals.SIGTERM) -> None:
        """After ``signum`` (on any rank), the next :meth:`maybe_save` writes a final persistent
        checkpoint and exits with status 0. Costs one small all-reduce per ``maybe_save``."""
        previous = signals.getsignal(signum)

        def handler(received: int, frame: Any) -> None:
            self._signalled = True
            logger.warning("signal %d received: saving at the next step, then stopping", received)
            if callable(previous) and previous not in (signals.SIG_IGN, signals.SIG_DFL):
                previous(received, frame)

        signals.signal(signum, handler)
        self._watching_signal = True

    def _agree_on_signal(self) -> bool:
        return bool(tpdist.reduce_ints([self._signalled], "max", "agreeing on a signal")[0])

    def wait_for_snapshot(self, timeout: float | None = None) -> None:
        """With ``overlap_snapshot``: return once the snapshot copy in flight (if any) is done, so
        that the state's tensors may change. Not collective; the optimizers' steps call it."""
        self.queues.wait_for_snapshot(timeout)

    def stats(self) -> dict[str, Any]:
        """Counts, blocking time per save and time to durable per tier (medians of the last 1000
        saves of each tier; counts, maxima and totals of all), and the last 1000 restores."""
        return self._events.summary()

    def close(self, abort: bool = False) -> None:
        """Wait for what is in flight, then stop the workers and free the local tier's memory
        (:meth:`LocalCheckpointManager.close`). Idempotent.

        ``abort=True`` (what leaving a ``with`` block by an exception other than ``sys.exit(0)``
        does): no collective, no
        waiting for other ranks, which after an exception or a Ctrl-C may be anywhere: the workers
        are killed and the saves in flight are dropped (named in a WARNING; their files are never
        taken for checkpoints). A plain ``close()`` that is interrupted (a second Ctrl-C) or fails
        while it waits ends as ``abort=True`` does: what is still in flight is dropped, never
        waited for a second time."""
        if self._closed:
            return
        try:
            if abort:
                self._aborting = True  # (the saves dropped are recorded as such)
                self.queues.close(abort=True)
            else:
                self.wait()
        except BaseException:
            abort = True
            raise
        finally:
            self._closed = True
            try:
                if self.local is not None:
                    self.local.wait_for_warm_up()
            finally:
                self._aborting = self._aborting or abort
                self.queues.close(abort=abort)
                self._staging_pool.close()
                if self.local is not None and self.local.repl_strategy is not None:
                    if not abort:  # the replicas a restore gives back travel on its groups
                        self.local.wait_for_restore()
                    self.local.repl_strategy.reset()  # frees its gloo groups: this manager made it
                if self.local is not None and not abort:  # (a stuck snapshot may still copy)
                    self.local.close()  # its mappings pin its files' pages, removed ones too

    def __enter__(self) -> TieredCheckpointManager:
        return self

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        self.close(abort=not ends_cleanly(error))

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise CheckpointingError("this TieredCheckpointManager is closed")

    def _check_step(self, step: Any, saving: bool = False, final: bool = False) -> int:
        step = checked_step(step, self._last_step, saving, final)
        if saving and not self._looked_ahead:  # the first save of a manager that did not restore
            assert self.persistent_dir is not None
            refuse_going_back(self.persistent_dir, step, self.storage_options)
            self._looked_ahead = True
        return step
