"""Saving local checkpoints: agree on the iteration, write this rank's part, replicate, commit.

:class:`PartSaver` is a component of :class:`~tierpoint.local.LocalCheckpointManager`, made with
the manager's :class:`~tierpoint.local.store.PartStore`, its replication (or ``None``) and the save
settings (``keep_last``, ``recycle``).

Call order (:meth:`PartSaver.save`, collective, after the manager checked the iteration and the
world): set up the replication; agree on the iteration and on what to keep
(:mod:`tierpoint.local.agreement`); remove every rank's leftover parts of that
iteration and newer ones (newer ones of another world size stay until the commit retires them) and
agree on it (the barrier before any rank writes); then, sync: write the
part, replicate, agree, :meth:`PartSaver.commit`; async: return an
:class:`~tierpoint.asyncsave.AsyncRequest` whose snapshot runs when the queue schedules it, whose
worker job (:mod:`tierpoint.local.jobs`) writes or seals the part, whose background step
replicates it (:mod:`tierpoint.local.replicas`) and whose finalization commits it (or
:meth:`PartSaver.abort` removes it). With ``device_snapshot`` an async save copies the state into
the :mod:`tierpoint.device_snapshot` before ``save`` returns; its snapshot reads that copy and
releases it.
:meth:`PartSaver.warm_up` (optional, any time before a save) prepares the staging buffer and spare
files in a background thread; every save first waits for it (an unfinished one fails the save on
every rank, agreed).

Invariants:
- Complete or invisible: a part becomes visible by renaming its dirty file after fsync; the previous
  complete checkpoint is retired only after every rank agreed that the new one is committed; no
  iteration is completed by the parts of two saves (each part records the save's token, agreed
  with the iteration; the load compares them). A save is refused only below a newer loadable
  iteration (or an async save still in flight).
- All ranks agree on the iteration, its success or failure (every rank raises the same
  :class:`CheckpointingError` and removes the failed iteration's files); the commit after that
  agreement never raises on one rank alone (a directory gone or read-only: a WARNING, the next
  commit retires what this one could not).
- Recycling: a file no complete checkpoint needs any more becomes a spare whose pages the next save
  rewrites (several times faster on tmpfs than filling a new file).
- Async snapshots on a RAM tier go straight into the pending part's dirty file (a recycled spare,
  its space reserved before anything is copied) through the store's mappings, page-locked once per
  file for CUDA tensors (so the device-to-host copy lands in the file at the pinned rate, and no
  second host copy of the state exists); only the snapshot of the pending save writes through such
  a mapping, and the worker only hashes (what the snapshot did not) and seals the file. On a disk
  tier, or without recycling, the snapshot goes into a reused memfd staging buffer
  (:mod:`tierpoint.staging`). The copy into a part file and what an abort does to it:
  :mod:`tierpoint.local.in_place`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any

from .. import dist as tpdist
from .. import fileformat, peers
from ..asyncsave.request import AsyncRequest, Commit
from ..device_snapshot import OVERWRITTEN, DeviceSnapshot, Ticket
from ..errors import CheckpointingError
from ..files import in_memory_filesystem
from ..pinning import copy_device
from ..snapshot_copy import training_streams
from ..staging import Stager
from ..tensor_aware import TensorAwareStateDict
from ..tree import FlatState
from . import naming
from .agreement import AfterCommit, agree_on_iteration
from .in_place import InPlaceCopies
from .jobs import seal_staged_part, write_staged_part
from .replicas import replicate_part, write_user_replicas
from .replication import UserReplication
from .store import PartStore

logger = logging.getLogger("tierpoint")


class PartSaver:
    """Sync and async saves of this rank's part over ``store``.

    Args:
        store: the rank's part files.
        replication: the manager's replication (a clique strategy or a user's, wrapped), or ``None``.
        keep_last: how many complete iterations to keep (the newest ones).
        recycle: reuse the pages of expired part files for new ones.
    """

    def __init__(
        self,
        store: PartStore,
        replication: Any,
        *,
        keep_last: int,
        recycle: bool,
        device_snapshot: bool = False,
    ) -> None:
        self.store = store
        self.replication = replication
        self.keep_last = keep_last
        self.recycle = recycle
        self.pending: int | None = None  # the async save scheduled and not finalized
        self.requested: set[int] = set()  # async saves handed out, not yet finalized or aborted
        # The iterations complete after this rank's last commit, and its sorted listing then.
        self.after_commit: AfterCommit | None = None
        self.last_replication: peers.MoveStats | None = None
        self.stager = Stager()
        self.device_snapshot = DeviceSnapshot() if device_snapshot else None
        self._ticket_request: AsyncRequest | None = None  # the request holding the latest ticket
        self._tier_in_memory: bool | None = None
        self._warming: threading.Thread | None = None
        self.in_place = InPlaceCopies(store)
        self._last_plan: fileformat.PartPlan | None = None  # its layout serves the next save's plan
        self._save_token = "0" * 16  # the save being made (see local.agreement)

    def save(
        self,
        state: TensorAwareStateDict,
        iteration: int,
        is_async: bool = False,
        refusal: CheckpointingError | None = None,
    ) -> AsyncRequest | None:
        """Save this rank's part of ``iteration`` (checked already). Collective; see the module
        docstring. ``refusal`` (an argument refused on this rank, a state that is not one here):
        raised on every rank by the iteration's agreement, which this rank still joins."""
        if refusal is None and not isinstance(state, TensorAwareStateDict):
            refusal = CheckpointingError(
                f"save expects a TensorAwareStateDict (e.g. BasicTensorAwareStateDict(state)), got {type(state).__name__}"
            )
        if (self.pending is not None or self.in_place.busy) and not is_async:
            raise CheckpointingError(
                f"the async save of iteration {self.pending} is not finalized yet: call "
                "AsyncCallsQueue.maybe_finalize_async_calls(blocking=True) before a sync save"
            )
        start = time.perf_counter()
        warm_up_timeout = self.join_warm_up()
        if self.replication is not None:
            self.replication.setup()  # collective on first use (lazy strategies create their group)
        keep, self._save_token = agree_on_iteration(
            self.store,
            iteration,
            keep_last=self.keep_last,
            in_flight=max(self.requested, default=naming.NO_CHECKPOINT),
            after_commit=self.after_commit,
            refusal=refusal,
        )
        logger.debug("save %d: iteration agreed in %.3f s", iteration, time.perf_counter() - start)
        replication = self.replication
        ticket: Ticket | None = None
        try:
            with tpdist.agree(f"saving local checkpoint iteration {iteration}"):
                if warm_up_timeout is not None:
                    raise warm_up_timeout
                # Before any rank writes (this agreement is the barrier): a part of this iteration
                # left by a killed job would complete it together with another rank's new part.
                self.store.remove_from(iteration)
                flat = state.to_flat()  # (here: a RefusedStateDict raises on every rank)
                plan = fileformat.plan_part(flat, self._extra(iteration), like=self._last_plan)
                self._last_plan = plan
                if is_async and self.device_snapshot is not None:
                    flat, ticket = self._take_device_snapshot(flat, plan)
            if not is_async:
                with tpdist.agree(f"writing local checkpoint iteration {iteration}"):
                    self._write_part(flat, plan, iteration)
            user_strategy = isinstance(replication, UserReplication)
            if replication is not None and (user_strategy or not is_async):
                with tpdist.agree(f"replicating local checkpoint iteration {iteration}"):
                    if user_strategy:  # as NVRx: in the training process, also for async saves
                        write_user_replicas(self.store, replication, state, iteration, self._extra)
                    else:
                        self.replicate(iteration, written=True)
        except CheckpointingError:
            self.abort(iteration)
            if ticket is not None:
                ticket.release()
            raise
        if not is_async:
            logger.debug(
                "save %d: written and agreed after %.3f s", iteration, time.perf_counter() - start
            )
            self.commit(iteration, keep, plan.data_size, start)
            return None
        self.requested.add(iteration)
        request = self._async_request(flat, plan, iteration, keep, ticket)
        if ticket is not None:
            self._ticket_request = request
        return request

    def _take_device_snapshot(
        self, flat: FlatState, plan: fileformat.PartPlan
    ) -> tuple[FlatState, Ticket]:
        """Copy ``flat``'s tensors into the device snapshot (see :mod:`tierpoint.device_snapshot`).
        The previous save's request holds the buffers until its snapshot ends; one never scheduled
        holds nothing (its snapshot will refuse to run)."""
        assert self.device_snapshot is not None
        previous = self._ticket_request
        copies, ticket = self.device_snapshot.take(
            flat.tensors,
            wait=tpdist.default_timeout().total_seconds(),
            void_unscheduled=previous is not None and not previous.scheduled,
            plan=plan,
        )
        return dataclasses.replace(flat, tensors=copies), ticket

    # ------------------------------------------------------------------------------ warming up

    def warm_up(self, state: TensorAwareStateDict) -> None:
        """Prepare, in a background thread, what the first saves of ``state``'s layout would
        otherwise pay for: the staging buffer (allocated, faulted in, pinned for a state with CUDA
        tensors), or, on a RAM tier with recycling, the spare files the first saves write into
        (their pages allocated; mapped, and pinned for CUDA tensors, as the snapshot uses them).
        Not collective; the next save waits for it. Does nothing while an async save is
        unfinalized (its staging memory and spare files are in use)."""
        self.join_warm_up()
        if self.requested:
            logger.info("warm_up skipped: an async save is in flight (its memory is in use)")
            return
        flat = state.to_flat()
        # The header names the iteration: plan with one of about the next save's digits, so that
        # the spares have that save's size (a spare resized later is mapped and pinned anew).
        plan = fileformat.plan_part(
            flat, self._extra((self.store.latest or 0) + 1), like=self._last_plan
        )
        self._last_plan = plan
        try:
            self.store.ensure_dir()
        except OSError as e:  # not collective: the next save reports it on every rank
            raise CheckpointingError(f"warm_up: cannot create {self.store.directory}: {e}") from e
        in_place = self._snapshots_in_place()
        device = copy_device(flat.tensors)
        # Own parts in flight and kept, and the replicas of as many saves of other ranks.
        copies = self.replication.replication_factor if self.replication is not None else 1

        def warm() -> None:
            try:
                if self.device_snapshot is not None:
                    self.device_snapshot.prepare(flat.tensors, plan)
                if in_place:  # the spare files are the staging memory
                    self.store.make_spares(plan.file_size(), (self.keep_last + 1) * copies, device)
                else:
                    self.stager.warm(plan, device)
            except BaseException as e:  # noqa: BLE001 - the save goes on cold; said once
                logger.warning("warming up for the first local save failed: %s", str(e))

        thread = threading.Thread(target=warm, name="tierpoint-warm-up", daemon=True)
        thread.start()
        self._warming = thread

    def join_warm_up(self, timeout: float | None = None) -> CheckpointingError | None:
        """Wait for :meth:`warm_up`'s thread (default: the coordination timeout); the error to
        raise if it is still running then, else None."""
        thread = self._warming
        if thread is None:
            return None
        thread.join(tpdist.default_timeout().total_seconds() if timeout is None else timeout)
        if thread.is_alive():
            return CheckpointingError(
                f"rank {self.store.rank}: preparing the staging memory and spare files of the "
                "local tier did not finish in time (is the tier's file system stalled?)"
            )
        self._warming = None
        return None

    def _extra(self, iteration: int) -> dict[str, Any]:
        """The metadata a part of ``iteration`` saved by this rank carries."""
        return {
            "iteration": iteration,
            "rank": self.store.rank,
            "world_size": self.store.world_size,
            "session_id": self.store.session_id,
            "save": self._save_token,
        }

    # ------------------------------------------------------------------------------ commit, abort

    def commit(self, iteration: int, keep: set[int], nbytes: int, start: float) -> None:
        """Every rank committed ``iteration``: make it the latest and retire what is not kept.

        ``keep`` was chosen when the save was requested; an async save committed since then (the
        previous one, finalized in between) is newer than all of it and counts towards ``keep_last``.
        """
        store = self.store
        if store.latest is not None and store.latest < iteration:
            keep = set(sorted(keep | {store.latest}, reverse=True)[: self.keep_last - 1])
        self.pending = None
        self.requested.discard(iteration)
        store.latest = iteration
        self.after_commit = None
        copies = self.replication.replication_factor if self.replication is not None else 1
        store.remember_own_part(iteration)  # (retire lists the parts: no header read for it)
        try:
            store.retire(keep | {iteration}, max_spares=copies if self.recycle else 0)
            store.left_behind.retire(keep | {iteration})
        except OSError as e:  # clean-up after an agreed commit: never this rank's failure alone
            logger.warning("iteration %d committed; older files not retired: %s", iteration, e)
        else:  # the unloadable iterations went with the rest: the next save may agree by counting
            store.unloadable.clear()
        with contextlib.suppress(OSError, CheckpointingError):  # else the next save gathers
            self.after_commit = (frozenset(keep | {iteration}), sorted(store.scan()))
        tpdist.log_progress(
            f"saved local checkpoint iteration {iteration} (rank {store.rank})", nbytes, start
        )

    def abort(self, iteration: int) -> None:
        """``iteration`` failed on some rank (alike on every rank): remove its files here."""
        self.after_commit = None
        self.in_place.abort(iteration)  # its snapshot may still run (stuck)
        if self.pending == iteration:
            self.pending = None
        self.requested.discard(iteration)
        self.store.remove_iteration(iteration)
        self.store.latest = None
        if self.replication is not None:
            # Every rank aborts alike, so every rank replaces the group (a timed-out exchange may
            # have left messages in flight on the old one).
            self.replication.reset()

    # ------------------------------------------------------------------------------ writing

    def _write_part(self, flat: FlatState, plan: fileformat.PartPlan, iteration: int) -> None:
        path = self.store.part_path(iteration)
        # No dirty leftover while async saves are out: one may be a snapshot's file.
        spare = self.store.take_spare(not self.requested) if self.recycle else None
        if spare is not None:
            self.store.mappings.drop(spare)  # resized below, not through the kept mapping
        result = fileformat.write_flat(path, flat, plan=plan, recycle=spare)
        how = "recycled" if spare else "new"
        logger.debug("wrote %s (%d bytes, %.3f s, %s)", path, result.nbytes, result.seconds, how)

    def _async_request(
        self,
        flat: FlatState,
        plan: fileformat.PartPlan,
        iteration: int,
        keep: set[int],
        ticket: Ticket | None = None,
    ) -> AsyncRequest:
        path = self.store.part_path(iteration)
        start = time.perf_counter()
        in_place = self._snapshots_in_place()
        after = training_streams(flat.tensors)  # this thread's: the snapshot may run on another
        if in_place:
            self.stager.close()  # the part files are the staging memory now

        def snapshot() -> dict[str, Any]:
            try:
                return copy()
            finally:
                if ticket is not None:
                    ticket.release()  # the device snapshot's copies are read (or never will be)

        def copy() -> dict[str, Any]:
            # Runs when the queue schedules the request: after the previous save was finalized, so
            # the staging buffer and the spare file are free (refused otherwise, alike on every rank).
            if ticket is not None and not ticket.current:
                self.requested.discard(iteration)
                raise CheckpointingError(OVERWRITTEN)
            if self.pending is not None:
                self.requested.discard(iteration)
                raise CheckpointingError(
                    f"the async save of local iteration {iteration} was scheduled while the one of "
                    f"iteration {self.pending} is still in flight: nothing written (the local tier "
                    "keeps one async save in flight; use AsyncCallsQueue(max_in_flight=1), the "
                    "default)"
                )
            latest = self.store.latest
            if latest is not None and latest >= iteration:  # alike on every rank
                self.requested.discard(iteration)
                raise CheckpointingError(
                    f"the async save of local iteration {iteration} was scheduled after iteration "
                    f"{latest} was saved: nothing written (a stale request would retire "
                    "the newer checkpoint)"
                )
            self.pending = iteration
            spare = self.store.take_spare() if self.recycle else None
            t0 = time.perf_counter()
            # Off the training thread (an overlapped snapshot), hashing each piece just copied costs
            # little more than the copy and spares the worker a pass over the memory; on it, the
            # copy alone is what training waits for.
            hash_now = threading.current_thread() is not threading.main_thread()
            image = ticket.image if ticket is not None else None
            if in_place:
                checksums = self.in_place.copy(flat, plan, iteration, spare, hash_now, after, image)
                kwargs = {"checksums": checksums}
            else:
                buffer, checksums = (
                    self.stager.stage_and_hash(flat, plan, after, image)
                    if hash_now
                    else (self.stager.stage(flat, plan, after, image), None)
                )
                recycle = str(spare) if spare else None
                kwargs = {"buffer": buffer, "checksums": checksums, "recycle": recycle}
            logger.debug("snapshot of iteration %d: %.3f s", iteration, time.perf_counter() - t0)
            return kwargs

        clique = self.replication is not None and not isinstance(self.replication, UserReplication)
        return AsyncRequest(
            seal_staged_part if in_place else write_staged_part,
            (str(path), plan),
            [Commit(lambda: self.commit(iteration, keep, plan.data_size, start))],
            preload_fn=snapshot,
            abort_fns=[lambda: self.abort(iteration), *([ticket.release] if ticket else [])],
            state_copied=ticket is not None,
            description=f"async save of local checkpoint iteration {iteration}",
            background_fn=(lambda written: self.replicate(iteration, written)) if clique else None,
        )

    def _snapshots_in_place(self) -> bool:
        """Whether an async snapshot goes straight into the part file's pages: the tier is in RAM
        (so those pages are shared memory, as a staging buffer is) and spares are recycled (so the
        pages exist already and are reused, and so do their mappings, pinned for CUDA)."""
        if self._tier_in_memory is None:  # decided once: the tier does not change file system
            self._tier_in_memory = in_memory_filesystem(self.store.directory)
        return self.recycle and self._tier_in_memory

    # ------------------------------------------------------------------------------ replicating

    def replicate(self, iteration: int, written: bool) -> None:
        """See :func:`tierpoint.local.replicas.replicate_part` (collective)."""
        stats = replicate_part(self.store, self.replication, iteration, written, self.recycle)
        if stats is not None:
            self.last_replication = stats
