"""The save path of :class:`~tierpoint.TieredCheckpointManager`: each tier's save scheduled and timed,
the persistent copy made from the local part, finalizing, and the synchronous final save.

Call order (the manager's :meth:`save` validates and agrees on the step, then; ``_warm_up`` at
the first step not saved, ``_with_owed_copy`` at every step)::

    _make_room("local"); _start_deferred(); _save_local(step, tree)   # a step due locally
    _deferred = _Deferred(step, ...)       # its persistent copy, once the local save is committed
    _save_persistent(step, tree)           # a step due only persistently, or a DTensor state
    poll() / wait()                        # finalize; start the persistent copy when due
    _save_final(step, tree)                # final_save, after wait()

Invariants: each tier keeps one save in flight (:meth:`_make_room` waits for the previous one), in
its own queue and worker (:mod:`.queues`: a local save never waits behind a persistent upload); a
persistent copy is made from the local part's bytes only after the local save of its step is
committed on every rank, and is dropped if that save failed; it costs the training thread the
planning and no copy: the part is held (never recycled, so its bytes stay those of its step:
:meth:`~tierpoint.local.LocalCheckpointManager.hold_own_part`) and the worker writes its bytes into
the DCP files (:class:`~tierpoint.staging.SourceFile`) until the save is finalized or aborted,
which releases the hold; a persistent copy lost with its local save is made up for: the next step
is saved to the persistent tier from the state, and while local saves fail, persistent saves
snapshot the state (no tier is left empty because the other one is full); the persistent tier
retires older steps (:mod:`.retention`) only after a newer one is committed, on a thread of rank 0
(round trips to an object store the training thread need not wait for), only steps older than
the one just committed, and :meth:`wait` (so ``restore``, ``final_save`` and ``close``) waits for
it; a failed persistent save (its commit too) is a WARNING and a failed record, training goes on.

:class:`SavePath` is a mixin of the manager, holding no state of its own (it uses the attributes
annotated below, all set by the manager's constructor).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import dcp
from .. import dist as tpdist
from ..asyncsave.request import Commit
from ..dcp.step_dirs import step_path
from ..errors import (
    CheckpointingError,
    CoordinationTimeoutError,
    SameMachineReplicationException,
    StateMismatchError,
    UnsupportedStateError,
    error_text,
)
from ..local import HeldPart, LocalCheckpointManager
from ..tensor_aware import BasicTensorAwareStateDict, for_collective_save
from . import state as st
from .events import EventLog, SaveRecord, finalize_or_fail
from .pickled_values import NO_PICKLE_HINT
from .queues import TierQueues
from .replicas import ReplicaCheck
from .retention import retire_persistent_steps
from .runs import RUN_KEY, tagged

logger = logging.getLogger("tierpoint")

_RAISED_FROM_LOCAL_SAVES = (
    CoordinationTimeoutError,
    StateMismatchError,
    UnsupportedStateError,
    SameMachineReplicationException,
)

ABORTED = "dropped: the manager was closed by an exception (close(abort=True))"
"""The error of the records of saves in flight when the manager is aborted."""


@dataclass
class _Deferred:
    """A persistent save waiting for the local save of the same step to be committed."""

    step: int
    rank_local_keys: list[str]
    committed: bool = False


class SavePath:
    """Saving to the tiers, asynchronously through a queue per tier (see the module docstring)."""

    local: LocalCheckpointManager | None
    persistent_dir: str | None
    keep_persistent: int
    storage_options: dict[str, Any]
    queues: TierQueues
    _staging_pool: dcp.StagingPool
    _events: EventLog
    _deferred: _Deferred | None
    _in_flight: dict[str, int]  # tier -> call id of its save not yet finalized
    _aborting: bool  # close(abort=True) drops the saves in flight
    _retiring: threading.Thread | None  # rank 0: the persistent retention running
    _retire_next: int | None  # the commit it runs for once more (under _retire_lock)
    _retire_lock: threading.Lock
    _retention_started: bool  # a persistent commit since the last wait(): rank 0 retires
    _local_failing: bool  # the last local save failed: persistent saves snapshot the state
    _persistent_owed: int | None  # a step whose persistent copy was lost with its local save
    _replica_check: ReplicaCheck

    def _agree_on_step(self, step: int, refusal: UnsupportedStateError | None = None) -> None:
        """One all-reduce of three integers; the steps are gathered only when ranks disagree,
        the refusals (of a rank's state) only when some rank refused: raised on every rank."""
        what = "agreeing on the step to save"
        low, high, accepted = tpdist.reduce_ints([step, -step, refusal is None], "min", what)
        if not accepted:
            statuses = tpdist.all_gather_json(tpdist.failure_status(refusal), what)
            tpdist.raise_failures(what, statuses, refusal)
        if low != -high:
            steps = dict(enumerate(tpdist.all_gather_json(step, what)))
            raise CheckpointingError(f"ranks disagree on the step to save: {steps}")

    def _make_room(self, tier: str) -> None:
        """Each tier keeps one save in flight: wait (collective) for the previous one."""
        if (call := self._in_flight.get(tier)) is not None:
            self.queues.finalize(True, tier, through=call)

    def _schedule(
        self,
        tier: str,
        request: Any,
        record: SaveRecord,
        committed: Callable[[], None],
        failed: Callable[[], None],
    ) -> None:
        """Schedule ``request`` (this tier's save) and time its phases into ``record``: ``write``
        (the worker: write, hash, fsync, rename or upload), ``replicate`` (the local tier's copies
        to peers), ``commit`` (from this rank's part done to the commit on every rank: waiting for
        the slowest rank and the next poll, then ``.metadata`` or retirement)."""
        marks: dict[str, float] = {}
        snapshot, background = request.preload_fn, request.background_fn

        def timed_snapshot() -> Any:
            try:
                return snapshot() if snapshot is not None else None
            finally:
                marks["snapshot"] = time.perf_counter()

        def after_worker(ok: bool) -> None:
            marks["worker"] = time.perf_counter()
            if background is not None:
                background(ok)
                marks["background"] = time.perf_counter()

        request_ref = weakref.ref(request)  # (a cycle would keep a held part mapped till a GC)

        def done(outcome: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                self._in_flight.pop(tier, None)
                failure = getattr(request_ref(), "failure", None)  # (a failed call's agreed error)
                record.error = record.error or failure
                now = time.perf_counter()
                if "snapshot" in marks and "worker" in marks:
                    record.phases["write"] = max(0.0, marks["worker"] - marks["snapshot"])
                    last = marks.get("background", marks["worker"])
                    if "background" in marks:
                        record.phases["replicate"] = marks["background"] - marks["worker"]
                    record.phases["commit"] = now - last
                outcome()

            return run

        request.preload_fn, request.background_fn = timed_snapshot, after_worker
        finalize = finalize_or_fail(request.finalize_fns, record, done(committed), done(failed))
        request.finalize_fns, request.abort_fns = [finalize], [*request.abort_fns, done(failed)]
        self._in_flight[tier] = self.queues[tier].schedule_async_request(request)

    def _save_local(self, step: int, tree: dict, refusal: CheckpointingError | None) -> None:
        """``refusal``: why this rank refused its state (raised on every rank by the save)."""
        assert self.local is not None
        self._make_room("local")
        local_tree = tagged(st.local_form(tree), self.persistent_dir)
        record = SaveRecord("local", step, st.nbytes(local_tree))
        start = time.perf_counter()
        taken = for_collective_save(local_tree, NO_PICKLE_HINT, refusal)
        try:
            request = self.local.save(taken, step, is_async=True)
        except CheckpointingError as e:
            # Some rank's failure, agreed (its directory, a full disk): a failed save; else raised
            if not e.failures or isinstance(e, _RAISED_FROM_LOCAL_SAVES):
                raise
            self._agree_on_step(step)  # (ranks at other steps: that is raised)
            logger.warning("the local save of step %d failed; training goes on: %s", step, e)
            record.ok, record.error = False, f"the local save failed: {error_text(e)}"
            self._local_failing = True  # (a persistent save of this step goes straight there)
            self._events.emit(record)
            return

        def committed() -> None:
            record.phases["durable"] = time.perf_counter() - start
            self._local_failing = False
            if self._deferred is not None and self._deferred.step == step:
                self._deferred.committed = True
            self._events.emit(record)

        def failed() -> None:
            record.ok, record.error = False, record.error or "the local save failed on some rank"
            if self._aborting:
                record.error, self._deferred = ABORTED, None
            self._local_failing = True
            if self._deferred is not None and self._deferred.step == step:
                logger.warning(
                    "the persistent copy of step %d is not made from the local tier: its local "
                    "save failed; the next step is saved to the persistent tier instead",
                    step,
                )
                self._deferred = None
                self._persistent_owed = step
            self._events.emit(record)

        self._schedule("local", request, record, committed, failed)
        record.phases["snapshot"] = time.perf_counter() - start

    def _save_persistent(
        self, step: int, tree: dict[str, Any], held: HeldPart | None = None
    ) -> None:
        """Save ``tree`` to the persistent tier; with ``held`` (the local part ``tree`` maps), the
        worker writes the part's bytes and the part stays held until the save is over."""
        assert self.persistent_dir is not None
        path = step_path(self.persistent_dir, step)
        record = SaveRecord("persistent", step, st.nbytes(tree))
        start = time.perf_counter()

        def committed() -> None:
            record.phases["durable"] = time.perf_counter() - start
            self._retention_started = True  # (every rank: wait() meets rank 0 after it)
            if tpdist.get_rank() == 0:
                self._retire_in_background(step)
            self._events.emit(record)

        def failed() -> None:
            why = f"the save to {path} failed on some rank"
            record.ok, record.error = False, record.error or why
            if self._aborting:
                record.error = ABORTED
            else:
                logger.warning("persistent checkpoint of step %d failed; training goes on", step)
            self._events.emit(record)

        try:
            self._make_room("persistent")
            self._replica_check.check(tree, step)
            request = dcp.async_save_request(
                tree,
                path,
                storage_options=self.storage_options or None,
                overwrite=True,
                source_file=held.source if held is not None else None,
                staging_pool=self._staging_pool,
            )
            if held is not None:  # finalized or aborted: the worker read the part (or never will)
                request.finalize_fns = [Commit(held.release), *request.finalize_fns]
                request.abort_fns = [*request.abort_fns, held.release]
            self._schedule("persistent", request, record, committed, failed)
        except CheckpointingError as e:  # planning failed on some rank (agreed): skip this save
            if held is not None:
                held.release()
            record.ok, record.error = False, str(e)
            logger.warning("persistent checkpoint of step %d not saved: %s", step, e)
            self._events.emit(record)
            return
        except BaseException:
            if held is not None:
                held.release()
            raise
        phase = "snapshot" if held is None else "copy_from_local"
        record.phases[phase] = time.perf_counter() - start

    def _warm_up(self, step: int, state: Mapping[str, Any]) -> None:
        """Prepare the first saves' staging memory in the background (not collective): the local
        tier's (and its spare files), and the persistent tier's where its saves snapshot the state
        (no local tier, or a DTensor state); see :meth:`LocalCheckpointManager.warm_up`. The
        tiers' workers start too."""
        self.queues.start()
        try:
            tree = st.template(state)
            if self.local is not None:
                local_tree = tagged(st.local_form(tree), self.persistent_dir)
                self.local.warm_up(BasicTensorAwareStateDict(local_tree))
            if self.persistent_dir is not None and (self.local is None or st.has_dtensor(tree)):
                dcp.warm_up(
                    st.persistent_form(tree, tpdist.get_rank()),
                    step_path(self.persistent_dir, step),
                    staging_pool=self._staging_pool,
                )
        except CheckpointingError as e:  # the save says so, on every rank
            logger.debug("no warm-up: %s", e)

    def _with_owed_copy(self, step: int, tiers: tuple[str, ...]) -> tuple[str, ...]:
        """``tiers`` for ``step``, the persistent tier added when a copy was lost with its local
        save (agreed: a local failure is seen by every rank)."""
        owed, self._persistent_owed = self._persistent_owed, None
        if owed is None or "persistent" in tiers:
            return tiers
        why = f"the persistent copy of step {owed} was not made" if owed else "it holds no step"
        logger.warning("saving step %d to the persistent tier (%s)", step, why)
        return (*tiers, "persistent")

    def poll(self) -> None:
        """Finalize what finished on every rank (no collective when nothing is in flight) and start
        the persistent copy of a step whose local save was just committed."""
        self.queues.finalize(blocking=False)
        self._start_deferred()

    def _start_deferred(self) -> None:
        deferred = self._deferred
        if deferred is None or not deferred.committed:
            return
        self._deferred = None
        assert self.local is not None
        held: HeldPart | None = None
        try:  # a rank whose part is gone (its directory wiped) skips the copy with every other rank
            with tpdist.agree(f"reading the local part of step {deferred.step} to copy it"):
                held = self.local.hold_own_part(deferred.step)
        except CheckpointingError as e:
            if held is not None:
                held.release()
            logger.warning("the persistent copy of step %d is not made: %s", deferred.step, e)
            self._persistent_owed = deferred.step
            record = SaveRecord("persistent", deferred.step, 0, ok=False, error=str(e))
            self._events.emit(record)
            return
        tree = {k: v for k, v in held.tree.items() if k not in (st.SHARDING_KEY, RUN_KEY)}
        for key in deferred.rank_local_keys:
            tree[key] = st.RankLocal(tree[key])
        self._save_persistent(deferred.step, st.persistent_form(tree, tpdist.get_rank()), held)

    def wait(self) -> None:
        """Wait until every save in flight (and a pending persistent copy) is committed or failed,
        and the persistent retention they started is done. Collective."""
        self.queues.finalize(blocking=True)
        if self._deferred is not None:
            self.poll()
            self.queues.finalize(blocking=True)
        self._wait_for_retirement()

    def _retire_in_background(self, committed: int) -> None:
        """Rank 0, after a persistent commit: retire older steps on a thread (see the module
        docstring). One runs at a time, and this rank never waits for it here (the other ranks
        would be waiting for it in the next collective): while one runs, it runs once more for
        the newest commit when it is done (so :meth:`wait` and ``close`` leave ``keep_persistent``
        steps, however slow the store)."""
        with self._retire_lock:
            if self._retiring is not None:  # running: it picks this commit up
                self._retire_next = committed
                return

            def run(below: int | None) -> None:
                while below is not None:
                    try:
                        retire_persistent_steps(
                            self.persistent_dir, self.keep_persistent, self.storage_options, below
                        )
                    except Exception as e:  # noqa: BLE001 - the new checkpoint is committed; retried next time
                        logger.warning("the persistent tier's old steps were not retired: %s", e)
                    with self._retire_lock:
                        below, self._retire_next = self._retire_next, None
                        if below is None:
                            self._retiring = None

            self._retiring = threading.Thread(
                target=run, args=(committed,), name="tierpoint-retention", daemon=True
            )
            self._retiring.start()

    def _wait_for_retirement(self) -> None:
        """After a persistent commit since the last call: rank 0 joins the retention thread, for
        at most half the collectives' timeout (a thread still running then is left behind with a
        WARNING: a daemon, it removes ``.metadata`` first, so whatever it leaves is never
        complete), and every rank meets it then, so that no rank's ``wait`` returns while rank 0
        still removes old steps (every rank commits the same saves: all or none meet)."""
        if not self._retention_started:
            return
        self._retention_started = False
        thread = self._retiring
        if thread is not None:
            bound = min(self.queues.timeout, tpdist.default_timeout().total_seconds() / 2)
            thread.join(bound)
            if thread.is_alive():
                logger.warning(
                    "the persistent tier's retention has run for over %.0f s; going on without it",
                    bound,
                )
        tpdist.barrier("waiting for rank 0 to retire the persistent tier's old steps")

    def _save_final(self, step: int, tree: dict[str, Any]) -> None:
        """A synchronous save of ``step`` (nothing in flight): to the persistent tier, the local
        tier without one; returns once it is committed."""
        start = time.perf_counter()
        if self.persistent_dir is None:
            assert self.local is not None
            local_tree = st.local_form(tree)
            record = SaveRecord("local", step, st.nbytes(local_tree))
            if step != self.local.find_latest():
                self.local.save(for_collective_save(local_tree, NO_PICKLE_HINT), step)
        else:
            ptree = st.persistent_form(tree, tpdist.get_rank())
            record = SaveRecord("persistent", step, st.nbytes(ptree))
            self._replica_check.check(ptree, step)
            dcp.save(
                ptree,
                step_path(self.persistent_dir, step),
                storage_options=self.storage_options or None,
                overwrite=True,
            )
            if tpdist.get_rank() == 0:
                retire_persistent_steps(
                    self.persistent_dir, self.keep_persistent, self.storage_options
                )
        record.phases["snapshot"] = record.phases["durable"] = time.perf_counter() - start
        self._events.emit(record)
