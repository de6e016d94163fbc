"""TieredCheckpointManager: one object over every tier, saving by schedule and restoring the newest
checkpoint that is complete anywhere.

Call order (every rank, at the same points of the training loop)::

    manager = TieredCheckpointManager(local_dir, persistent_dir, "job", local_every=10,
                                      persistent_every=100)
    step = manager.restore(state)            # None when nothing exists anywhere
    for step in range((step or 0) + 1, total + 1):
        train_step()
        manager.maybe_save(step, state)      # returns after the snapshot; saves by schedule
    manager.close()                          # waits for what is in flight

The parts it composes: the local tier (:class:`~tierpoint.local.LocalCheckpointManager`, with clique
replication across nodes), the persistent tier (:mod:`tierpoint.dcp`, torch DCP files on a shared
path or an object store), one :class:`~tierpoint.asyncsave.AsyncCallsQueue` (one worker process per
rank serves both tiers), :mod:`.state` (stateful members taken apart and put back in place),
:mod:`.retention` and :mod:`.events`.

Restore order: the newest complete step of the local tier (parts fetched from peer replicas where a
node lost its own) if it is at least as new as the newest complete persistent step, else the
persistent steps newest first; a step that cannot be loaded on every rank (missing everywhere,
failing verification) is skipped with its reason, logged and kept in ``last_restore``. Every rank
gets the same answer: each decision is agreed.

Saving: a step due for both tiers is snapshotted once, into the local tier; its persistent copy is
made from the local part's bytes once the local save is committed on every rank (so never from a
training state that has moved on), except for DTensor states, whose persistent copy needs the
global layout and is snapshotted from the state at the same step. A persistent save that fails
(an unreachable store) is reported (WARNING, a failed record) and training and local saves go on;
the next persistent save tries again.

Invariants: at most two calls in flight (a local and a persistent save; a third waits for the
oldest); the persistent tier keeps ``keep_persistent`` complete steps and removes an older one only
after a newer one is committed (:mod:`.retention`); a restore that finds a different state
structure raises :class:`StateMismatchError` on every rank before anything is copied.
"""

from __future__ import annotations

import logging
import signal as signals
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import dcp, storage
from .. import dist as tpdist
from ..asyncsave import AsyncCallsQueue
from ..dcp.layout import complete_steps, local_view, step_path
from ..errors import CheckpointingError, CoordinationTimeoutError, StateMismatchError
from ..local import CliqueReplicationStrategy, LocalCheckpointManager
from ..tensor_aware import BasicTensorAwareStateDict
from . import state as st
from .events import EventLog, RestoreRecord, SaveRecord
from .retention import retire_persistent_steps

logger = logging.getLogger("tierpoint")

TIERS = ("local", "persistent")


@dataclass
class _Deferred:
    """A persistent save waiting for the local save of the same step to be committed."""

    step: int
    rank_local_keys: list[str]
    committed: bool = False


class TieredCheckpointManager:
    """Saves to the node-local and persistent tiers by schedule and restores from whichever holds
    the newest complete checkpoint (see the module docstring).

    Args:
        local_dir: node-local root (default ``/dev/shm/tierpoint-<uid>``).
        persistent_dir: shared path or fsspec URL (``s3://...``); ``None``: local tier only.
        session_id: separates jobs sharing a local root.
        local_every / persistent_every: save every N steps to that tier (0: never).
        replication_factor: copies of each local part, counting the original, kept on other nodes
            (1: none; with fewer nodes than copies, replication is off and a WARNING says so).
        replication_jump: distance between ranks holding copies (default: ranks per node).
        keep_local / keep_persistent: newest complete checkpoints kept in each tier.
        storage_options: fsspec options for ``persistent_dir`` (endpoint, credentials).
        on_event: called with a dict for every save and restore (see :mod:`.events`).
        timeout: seconds any wait may take (default ``TIERPOINT_TIMEOUT`` or 300).
        poll_every: ``maybe_save`` finalizes finished saves every N steps (and whenever a save is
            due). While a save is in flight each poll is one small all-gather, so polling every step
            costs training time; default: half the shortest save interval.

    Collective: construction (node layout), ``restore``, ``maybe_save``, ``save``, ``wait``,
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
    ) -> None:
        for name, value, low in (
            ("local_every", local_every, 0),
            ("persistent_every", persistent_every, 0),
            ("replication_factor", replication_factor, 1),
            ("keep_local", keep_local, 1),
            ("keep_persistent", keep_persistent, 1),
        ):
            if type(value) is not int or value < low:
                raise CheckpointingError(f"{name} must be an integer >= {low}, got {value!r}")
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
        self.storage_options = dict(storage_options or {})
        self.persistent_dir = (
            storage.checkpoint_path(persistent_dir, "persistent_dir") if persistent_every else None
        )
        self.local: LocalCheckpointManager | None = None
        if local_every:
            self.local = LocalCheckpointManager(
                local_dir,
                session_id,
                self._replication(replication_factor, replication_jump),
                keep_last=keep_local,
            )
        self.queue = AsyncCallsQueue(max_in_flight=2, timeout=timeout)
        if self.persistent_dir is not None:  # the worker's first persistent save needs them
            self.queue.preload("tierpoint.dcp.writer", "tierpoint.dcp.checksums")
        self.last_restore: RestoreRecord | None = None
        """What the last :meth:`restore` did (step, tier, seconds, bytes, skipped steps)."""
        self._events = EventLog(on_event)
        self._last_step: int | None = None
        self._deferred: _Deferred | None = None
        self._in_flight: dict[str, int] = {}  # tier -> call id of its save not yet finalized
        self._signalled = False
        self._watching_signal = False
        self._closed = False

    @staticmethod
    def _replication(factor: int, jump: int | None) -> CliqueReplicationStrategy | None:
        if factor < 2 or tpdist.get_world_size() < 2:
            return None
        nodes = len(tpdist.node_layout().nodes)
        if nodes < factor:
            if tpdist.get_rank() == 0:
                logger.warning(
                    "replication_factor=%d but the job spans %d node(s): local checkpoints are not "
                    "replicated (a lost node is restored from the persistent tier)",
                    factor,
                    nodes,
                )
            return None
        return CliqueReplicationStrategy(jump, factor)

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
        step = self._check_step(step)
        tiers = self.due(step)
        if step % self.poll_every == 0 or tiers:
            self.poll()
        if self._watching_signal and self._agree_on_signal():
            self.final_save(state, step)
            self.close()
            logger.warning("stopping after the final checkpoint of step %d (signal received)", step)
            sys.exit(0)
        if tiers:
            self.save(step, state, tiers)
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
        if "local" not in wanted:  # the local tier's save agrees on the step itself
            self._agree_on_step(step)
        self._last_step = step
        tree = st.template(state)
        rank_local = [k for k, v in tree.items() if isinstance(v, st.RankLocal)]
        sharded = _has_dtensor(tree)
        if "local" in wanted:
            # The previous local save is committed first; its persistent copy (if due) starts now.
            self._make_room("local")
            self._start_deferred()
            self._save_local(step, tree)
        if "persistent" in wanted:
            if "local" in wanted and not sharded:
                self._deferred = _Deferred(step, rank_local)
            else:
                self._save_persistent(step, st.persistent_form(tree, tpdist.get_rank()))

    def _make_room(self, tier: str) -> None:
        """Each tier keeps one save in flight: wait (collective) for the previous one."""
        call = self._in_flight.get(tier)
        if call is not None:
            try:
                self.queue.finalize_through(call)
            except CheckpointingError as e:
                logger.warning("a checkpoint save failed: %s", e)

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

        def done(outcome: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                self._in_flight.pop(tier, None)
                now = time.perf_counter()
                if "snapshot" in marks and "worker" in marks:
                    record.phases["write"] = max(0.0, marks["worker"] - marks["snapshot"])
                    last = marks.get("background", marks["worker"])
                    if "background" in marks:
                        record.phases["replicate"] = marks["background"] - marks["worker"]
                    record.phases["commit"] = now - last
                outcome()

            return run

        request.preload_fn = timed_snapshot
        request.background_fn = after_worker
        request.add_finalize_fn(done(committed))
        request.abort_fns = [*request.abort_fns, done(failed)]
        self._in_flight[tier] = self.queue.schedule_async_request(request)

    def _save_local(self, step: int, tree: dict[str, Any]) -> None:
        assert self.local is not None
        self._make_room("local")
        local_tree = st.local_form(tree)
        record = SaveRecord("local", step, _nbytes(local_tree))
        start = time.perf_counter()
        request = self.local.save(BasicTensorAwareStateDict(local_tree), step, is_async=True)

        def committed() -> None:
            record.phases["durable"] = time.perf_counter() - start
            if self._deferred is not None and self._deferred.step == step:
                self._deferred.committed = True
            self._events.emit(record)

        def failed() -> None:
            record.ok, record.error = False, "the local save failed on some rank"
            if self._deferred is not None and self._deferred.step == step:
                logger.warning(
                    "the persistent copy of step %d is not made: its local save failed", step
                )
                self._deferred = None
            self._events.emit(record)

        self._schedule("local", request, record, committed, failed)
        record.phases["snapshot"] = time.perf_counter() - start

    def _save_persistent(self, step: int, tree: dict[str, Any], snapshot: bool = True) -> None:
        assert self.persistent_dir is not None
        path = step_path(self.persistent_dir, step)
        record = SaveRecord("persistent", step, _nbytes(tree))
        start = time.perf_counter()

        def committed() -> None:
            record.phases["durable"] = time.perf_counter() - start
            if tpdist.get_rank() == 0:
                t0 = time.perf_counter()
                retire_persistent_steps(
                    self.persistent_dir, self.keep_persistent, self.storage_options
                )
                record.phases["cleanup"] = time.perf_counter() - t0
            self._events.emit(record)

        def failed() -> None:
            record.ok, record.error = False, f"the save to {path} failed on some rank"
            logger.warning("persistent checkpoint of step %d failed; training goes on", step)
            self._events.emit(record)

        try:
            self._make_room("persistent")
            request = dcp.async_save_request(
                tree, path, storage_options=self.storage_options or None, overwrite=True
            )
            self._schedule("persistent", request, record, committed, failed)
        except CheckpointingError as e:  # planning failed on some rank (agreed): skip this save
            record.ok, record.error = False, str(e)
            logger.warning("persistent checkpoint of step %d not saved: %s", step, e)
            self._events.emit(record)
            return
        record.phases["snapshot" if snapshot else "copy_from_local"] = time.perf_counter() - start

    def poll(self) -> None:
        """Finalize what finished on every rank (no collective when nothing is in flight) and start
        the persistent copy of a step whose local save was just committed."""
        self._finalize(blocking=False)
        self._start_deferred()

    def _start_deferred(self) -> None:
        deferred = self._deferred
        if deferred is None or not deferred.committed:
            return
        self._deferred = None
        assert self.local is not None
        tree = self.local.read_own_part(deferred.step)
        tree.pop(st.SHARDING_KEY, None)
        for key in deferred.rank_local_keys:
            tree[key] = st.RankLocal(tree[key])
        self._save_persistent(
            deferred.step, st.persistent_form(tree, tpdist.get_rank()), snapshot=False
        )

    def _finalize(self, blocking: bool) -> None:
        try:
            self.queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointingError as e:
            # The failed call's record says which save; training goes on with the last good ones.
            logger.warning("a checkpoint save failed: %s", e)

    def wait(self) -> None:
        """Wait until every save in flight (and a pending persistent copy) is committed or failed."""
        self._finalize(blocking=True)
        if self._deferred is not None:
            self.poll()
            self._finalize(blocking=True)

    def final_save(self, state: Mapping[str, Any], step: int) -> None:
        """Write a synchronous checkpoint of ``step``: to the persistent tier (the local tier
        without one). For the end of training or a preemption; returns once it is committed."""
        self._refuse_if_closed()
        self.wait()
        step = self._check_step(step, saving=True, final=True)
        self._agree_on_step(step)
        self._last_step = step
        tree = st.template(state)
        start = time.perf_counter()
        if self.persistent_dir is None:
            assert self.local is not None
            local_tree = st.local_form(tree)
            record = SaveRecord("local", step, _nbytes(local_tree))
            if step != self.local.find_latest():
                self.local.save(BasicTensorAwareStateDict(local_tree), step)
        else:
            ptree = st.persistent_form(tree, tpdist.get_rank())
            record = SaveRecord("persistent", step, _nbytes(ptree))
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

    # ------------------------------------------------------------------------------ restoring

    def restore(self, state: dict[str, Any]) -> int | None:
        """Load the newest checkpoint complete anywhere into ``state`` in place; return its step
        (``None``, state untouched, when there is none). Collective; the same answer on every rank.
        """
        self._refuse_if_closed()
        self.wait()
        start = time.perf_counter()
        fresh = st.init_optimizers(state)
        try:
            record = self._restore(state, start)
        except BaseException:
            _reset(fresh)
            raise
        if record.step is None:
            _reset(fresh)
        else:
            self._last_step = record.step
        self.last_restore = record
        self._events.emit(record)
        return record.step

    def _restore(self, state: dict[str, Any], start: float) -> RestoreRecord:
        tree = st.template(state)
        skipped: list[str] = []
        persistent = self._persistent_candidates(skipped)
        newest_persistent = persistent[0] if persistent else -1
        if self.local is not None:
            record = self._restore_local(state, tree, newest_persistent, skipped, start)
            if record is not None:
                return record
        for step in persistent:
            record = self._restore_persistent(state, tree, step, skipped, start)
            if record is not None:
                return record
        return RestoreRecord(None, None, time.perf_counter() - start, 0, skipped)

    def _persistent_candidates(self, skipped: list[str]) -> list[int]:
        """The complete persistent steps, newest first, as rank 0 lists them (one listing per job)."""
        if self.persistent_dir is None:
            return []
        steps, error = None, None
        if tpdist.get_rank() == 0:
            try:
                steps = complete_steps([local_view(self.persistent_dir, self.storage_options)])
            except CheckpointingError as e:
                error = str(e)
        steps, error = tpdist.broadcast_json(
            [steps, error], 0, f"listing persistent checkpoints under {self.persistent_dir}"
        )
        if error is not None:
            skipped.append(f"persistent tier: cannot list {self.persistent_dir}: {error}")
            logger.warning("restore: cannot list the persistent tier: %s", error)
            return []
        return steps

    def _restore_local(
        self,
        state: dict[str, Any],
        tree: dict[str, Any],
        newest_persistent: int,
        skipped: list[str],
        start: float,
    ) -> RestoreRecord | None:
        local = self.local
        assert local is not None
        latest = local.find_latest()
        if latest == -1:
            return None
        if latest < newest_persistent:
            skipped.append(f"local step {latest}: older than persistent step {newest_persistent}")
            return None
        try:
            ta, _ = local.load()
        except CheckpointingError as e:
            skipped.append(f"local tier: {e}")
            logger.warning("restore: no local checkpoint could be loaded: %s", e)
            return None
        record = local.last_load
        assert record is not None
        if record.iteration < newest_persistent:
            skipped.append(
                f"local steps newer than {record.iteration}: cannot be loaded on every rank"
            )
            return None
        loaded = ta.state_dict
        live = st.local_form(tree)
        with tpdist.agree(f"checking the state against local checkpoint step {record.iteration}"):
            problems = st.check_loaded(live, loaded)
            if problems:
                raise StateMismatchError(_mismatch(record.iteration, problems))
        loaded.pop(st.SHARDING_KEY, None)  # checked above; not part of the state
        st.copy_into(tree, loaded)
        st.apply(state, tree)
        tier = "peers" if record.from_peers else "local"
        if record.iteration != latest:  # (find_latest again would wait for the replicas)
            skipped.append(f"newer local steps than {record.iteration}: could not be loaded")
        return RestoreRecord(
            record.iteration, tier, time.perf_counter() - start, record.nbytes, skipped
        )

    def _restore_persistent(
        self,
        state: dict[str, Any],
        tree: dict[str, Any],
        step: int,
        skipped: list[str],
        start: float,
    ) -> RestoreRecord | None:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        assert self.persistent_dir is not None
        path = step_path(self.persistent_dir, step)
        options = self.storage_options or None
        rank = tpdist.get_rank()
        source = rank
        try:
            with tpdist.agree(f"reading the metadata of {path}"):
                metadata = dcp.read_metadata(path, storage_options=options)
        except (StateMismatchError, CoordinationTimeoutError):
            raise
        except CheckpointingError as e:
            return self._skip(skipped, step, e)
        prefix = f"{st.RANK_LOCAL_KEY}.{rank}."
        if not any(k.startswith(prefix) for k in metadata.state_dict_metadata):
            source = 0  # saved with fewer ranks: rank 0's values, as after any resharding
        ptree = st.persistent_form(tree, source)
        with tpdist.agree(f"checking the state against persistent step {step}"):
            flat, _ = flatten_state_dict(ptree)
            problems = st.check_against_metadata(flat, metadata)
            if problems:
                raise StateMismatchError(_mismatch(step, problems))
        try:
            dcp.load(ptree, path, storage_options=options)
        except (StateMismatchError, CoordinationTimeoutError):
            raise
        except CheckpointingError as e:
            return self._skip(skipped, step, e)
        st.from_persistent_form(tree, ptree, source)
        st.apply(state, tree)
        return RestoreRecord(
            step, "persistent", time.perf_counter() - start, _nbytes(ptree), skipped
        )

    @staticmethod
    def _skip(skipped: list[str], step: int, error: BaseException) -> None:
        skipped.append(f"persistent step {step}: {error}")
        logger.warning("restore: skipping persistent step %d: %s", step, error)

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

    def stats(self) -> dict[str, Any]:
        """Counts, blocking time per save and time to durable per tier, and the restores."""
        return self._events.summary()

    def close(self) -> None:
        """Wait for what is in flight, then stop the worker. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self.queue.close()

    def __enter__(self) -> TieredCheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise CheckpointingError("this TieredCheckpointManager is closed")

    def _check_step(self, step: Any, saving: bool = False, final: bool = False) -> int:
        if isinstance(step, bool) or not isinstance(step, int) and not hasattr(step, "__index__"):
            raise CheckpointingError(f"step must be a non-negative integer, got {step!r}")
        step = int(step.__index__())
        if step < 0:
            raise CheckpointingError(f"step must be a non-negative integer, got {step}")
        last = self._last_step
        if last is not None and (step < last or (step == last and saving and not final)):
            raise CheckpointingError(
                f"step {step} after step {last}: steps must increase (restore() or a new manager "
                "to go back)"
            )
        return step

    def _agree_on_step(self, step: int) -> None:
        """One all-reduce of two integers; the steps are gathered only when ranks disagree."""
        what = "agreeing on the step to save"
        low, high = tpdist.reduce_ints([step, -step], "min", what)
        if low != -high:
            steps = tpdist.all_gather_json(step, what)
            raise CheckpointingError(
                f"ranks disagree on the step to save: {dict(enumerate(steps))}"
            )


def _has_dtensor(tree: Any) -> bool:
    return any(st.is_dtensor(t) for t in st.tensors_of(tree))


def _nbytes(tree: Any) -> int:
    """Bytes of this rank's tensors (a DTensor's local shard)."""
    local = (t.to_local() if st.is_dtensor(t) else t for t in st.tensors_of(tree))
    return sum(t.numel() * t.element_size() for t in local)


def _mismatch(step: int, problems: list[str]) -> str:
    return (
        f"the state does not match the checkpoint of step {step} (nothing was loaded): "
        + "; ".join(problems)
    )


def _reset(optimizers: list[torch.optim.Optimizer]) -> None:
    """Give optimizers initialised for a restore that did not happen their empty state back."""
    for optimizer in optimizers:
        optimizer.state.clear()
