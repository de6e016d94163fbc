"""Loading local checkpoints: verify this rank's part, fetch missing or corrupt parts from peers,
fall back to older iterations, and give a replaced node back the replicas it should hold.

:class:`PartRecovery` is a component of :class:`~tierpoint.local.LocalCheckpointManager`, made
with the manager's :class:`~tierpoint.local.store.PartStore`, its replication (or ``None``) and the
load settings; it records the loaded iteration in the store (``store.latest``) and the ones it
fell back from (``store.unloadable``).

Call order: the manager finds the latest iteration, then calls :meth:`PartRecovery.load`
(collective): for that iteration and then each older one (``older``, asked once): every rank reads
and verifies its own part; the ranks gather what each holds (merged per node), every rank makes the
same retrieval plan (:mod:`tierpoint.local.retrieval`); the moves run (:mod:`tierpoint.peers.transfer`,
verified as they land); repeat until nothing is needed or a part has no good copy left (then the
next older iteration); then one agreement checks that every rank's part comes from the same save
(when not, the statuses are gathered once more and the plan replaces the parts of other saves).
After the load, the replicas this rank should hold but lacks (or holds from another save) are
planned the same way and fetched on a background thread (:meth:`PartRecovery.wait_for_restore`,
which the manager calls first in every later collective call).

Invariants:
- A load never returns a part that failed verification: a fetch counts only when a new, verified
  file took the part's name; otherwise the next holder is tried, then an older iteration.
- Every rank returns the same iteration or raises the same error.
- A load never returns parts of two saves of one iteration: the plan takes one save's copies
  (:mod:`tierpoint.local.retrieval`) and the save tokens of the loaded parts are agreed before any
  is returned (else the next older iteration). The statuses carry each copy's save; when every part
  is present nothing is gathered, unless the tokens disagree.
- Replicas of a replaced node come from the origin first (its part was verified by the load).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .. import dist as tpdist
from .. import fileformat
from ..errors import CheckpointingError, CorruptCheckpointError, agreed_error
from ..tensor_aware import BasicTensorAwareStateDict, TensorAwareStateDict
from ..tree import FlatState
from . import naming, node_reports
from .naming import CkptID
from .retrieval import HolderStatus, RetrievalPlan, plan_retrieval
from .store import PartStore

logger = logging.getLogger("tierpoint")


@dataclass(frozen=True)
class LoadRecord:
    """What the last successful :meth:`PartRecovery.load` did: the iteration, whether any rank's
    part came from a peer (the same on every rank: the plan is agreed), this rank's bytes and
    seconds, and why each newer iteration tried first could not be loaded."""

    iteration: int
    from_peers: bool
    nbytes: int
    seconds: float
    skipped: tuple[str, ...] = ()


class PartRecovery:
    """Load, peer retrieval and replica restore over ``store``.

    Args:
        store: the rank's part files.
        replication: the manager's replication (a clique strategy or a user's, wrapped), or ``None``.
        verify: check every tensor checksum of this rank's part on load.
        mmap_load: map the part file copy-on-write instead of copying it.
    """

    def __init__(
        self, store: PartStore, replication: Any, *, verify: bool, mmap_load: bool
    ) -> None:
        self.store = store
        self.replication = replication
        self.verify = verify
        self.mmap_load = mmap_load
        self.last_load: LoadRecord | None = None
        self._restore: threading.Thread | None = None
        self._fetch_error = ""  # why the last fetch wrote nothing here (a full disk), if it did not

    def load(
        self, iteration: int, older: Callable[[int], list[int]], *, allow_pickle: bool = False
    ) -> tuple[TensorAwareStateDict, CkptID]:
        """Load this rank's part of ``iteration`` (the latest complete one), else of the newest of
        ``older(iteration)`` that every rank can have. Collective.

        Missing or corrupt own parts are fetched from their holders first; replicas a replaced node
        should hold are restored in the background after this returns (see :meth:`wait_for_restore`).
        ``allow_pickle``: also load objects saved with ``allow_pickle=True`` (only for trusted files).
        """
        failures: dict[int, str] = {}
        kinds: set[str] = set()
        candidates = [iteration]
        skipped: list[str] = []
        while candidates:
            candidate = candidates.pop(0)
            found: dict[int, str] = {}  # this candidate's failures
            loaded = self._load_iteration(candidate, found, kinds, allow_pickle)
            if loaded is not None:
                if skipped and self.last_load is not None:
                    self.last_load = replace(self.last_load, skipped=tuple(skipped))
                return loaded
            failures.update(found)
            why = "; ".join(f"rank {r}: {m}" for r, m in sorted(found.items()))
            skipped.append(f"local step {candidate}: {why or 'cannot be loaded on every rank'}")
            self.store.unloadable.add(candidate)  # newer than what the job resumes from: not kept
            if candidate == iteration:
                # Every rank alike (_load_iteration agrees).
                candidates = older(iteration)
        where = self.store.session_dir
        detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
        raise agreed_error(
            kinds.pop() if len(kinds) == 1 else "",
            f"no local checkpoint under {where} could be loaded on every rank: {detail}",
            failures,
        )

    def read_own(
        self,
        iteration: int,
        allow_pickle: bool,
        verify: bool | None = None,
        mmap: bool | None = None,
    ) -> tuple[Any, str, str]:
        """This rank's part of ``iteration`` read and checked (``verify``: the checksums too;
        ``mmap``: map it; both by default as the manager was made): ``(loaded, reason, error
        kind)``, ``loaded`` being ``(header, tensors)`` or ``None`` (then ``reason`` and the kind
        say why). No collective."""
        path = self.store.part_path(iteration)
        verify = self.verify if verify is None else verify
        mmap = self.mmap_load if mmap is None else mmap
        try:
            header, tensors = fileformat.read_flat(path, verify=verify, mmap=mmap)
            meta = header.extra
            if not naming.metadata_names(meta, iteration, self.store.rank):
                # another part under this name (swapped or copied over): intact, but not this one
                raise CorruptCheckpointError(str(path), "file name disagrees with its metadata")
            # validates the skeleton before use; DTensors are built (on their mesh, which may create
            # process groups: every rank at once) when the state is first used
            fileformat.unflatten_checked(
                header, tensors, allow_pickle=allow_pickle, build_dtensors=False
            )
            return (header, tensors), "", ""
        except FileNotFoundError:
            return None, f"{path}: missing", "CheckpointingError"
        except (OSError, CheckpointingError) as e:
            return None, str(e), type(e).__name__

    def _load_iteration(
        self, iteration: int, failures: dict[int, str], kinds: set[str], allow_pickle: bool
    ) -> tuple[TensorAwareStateDict, CkptID] | None:
        """Load ``iteration``, fetching missing or corrupt parts from peers. Collective.

        Returns ``None`` on every rank alike when some rank's part cannot be had (noting why in
        ``failures`` / ``kinds``).
        """
        start = time.perf_counter()
        loaded, reason, kind = self.read_own(iteration, allow_pickle)
        first_reason = reason
        from_peers = mixed = same = False  # mixed: copies of more than one save were seen
        bad: list[list[int]] = []
        group = self.replication.group if self.replication else tpdist.coordination_group()
        what = f"loading local checkpoint iteration {iteration}"
        for _ in range(self.store.world_size + 2):
            status = self._status(iteration, loaded is not None, bad)
            # Own parts only; replicas are restored after the load. Once the parts loaded came
            # from different saves, the statuses are gathered (the plan compares the saves).
            statuses, plan = self._agree_on_plan(
                status, None, what, force=mixed, reason=reason, kind=kind
            )
            mixed |= plan.mixed
            refused = {
                r: s["reason"]
                for r, s in enumerate(statuses)
                if s["kind"] == "UnsupportedStateError"
            }
            if refused:  # intact files this call may not load (pickled objects): no fallback
                detail = "; ".join(f"rank {r}: {m}" for r, m in refused.items())
                raise agreed_error("UnsupportedStateError", f"{what}: {detail}", refused)
            if plan.lost:
                newest = " from the newest save" if mixed else ""
                for r in plan.lost:
                    failures[r] = statuses[r]["reason"] or f"no copy of its part{newest}"
                    kinds.add(statuses[r]["kind"] or "CheckpointingError")
                logger.warning(
                    "local iteration %d cannot be restored: no rank holds a good copy of the part "
                    "of rank%s %s%s",
                    iteration,
                    "s" if len(plan.lost) > 1 else "",
                    ", ".join(map(str, plan.lost)),
                    f" (its parts come from different saves of this iteration; none{newest})"
                    if mixed
                    else "",
                )
                return None
            if not plan.moves:
                same = self._same_save(loaded, reason, what)
                if same or mixed:
                    break
                mixed = True  # (every rank alike) plan again, comparing the saves
                continue
            from_peers = True
            self._log_plan(iteration, plan, "part(s) from peers")
            source = next((s for s, d, o in plan.moves if d == self.store.rank == o), None)
            if loaded is not None and source is not None:  # intact, but from another save
                loaded, reason = None, f"{self.store.part_path(iteration)}: from another save"
                first_reason = reason
            failed = self._fetch(iteration, plan, group)
            bad += failed  # sources that failed stay excluded
            if loaded is None and source is not None and [source, self.store.rank] not in failed:
                # Every checksum was verified on receipt: no second pass over the bytes.
                loaded, reason, kind = self.read_own(iteration, allow_pickle, verify=False)
                if loaded is not None:
                    logger.warning(  # the reason names the file
                        "local part of iteration %d replaced by the copy held by rank %d: %s",
                        iteration,
                        source,
                        first_reason,
                    )
                else:
                    bad.append([source, self.store.rank])
            elif (
                loaded is None and self._fetch_error
            ):  # the copy arrived, this rank could not keep it
                reason = f"{first_reason}; fetching a copy failed: {self._fetch_error}"
        else:
            same = self._same_save(loaded, reason, what)
        if not same:  # e.g. a node back with an earlier run's parts and no other copy of some
            reason = "its parts come from different saves of this iteration (intact, not loaded)"
            failures.update(dict.fromkeys(range(self.store.world_size), reason))
            kinds.add("CheckpointingError")
            logger.warning("local iteration %d cannot be restored: %s", iteration, reason)
            return None
        header, tensors = loaded
        flat = FlatState(header.skeleton, tensors, [r.name for r in header.records])
        ta = BasicTensorAwareStateDict.from_flat(
            flat, [r.device for r in header.records], allow_pickle=allow_pickle
        )
        ta.restore_tensor_device()
        tpdist.log_progress(
            f"loaded local checkpoint iteration {iteration} (rank {self.store.rank})",
            header.file_size,
            start,
        )
        self.store.latest = iteration
        self.last_load = LoadRecord(
            iteration, from_peers, header.file_size, time.perf_counter() - start
        )
        self._restore_replicas(iteration, mixed)
        return ta, CkptID(iteration, self.store.rank, self.store.session_id)

    def _status(self, iteration: int, own_ok: bool, bad: list[list[int]]) -> HolderStatus:
        saves = self.store.held_saves(iteration)
        return HolderStatus(own_ok, list(saves), bad, list(saves.values()))

    def _same_save(self, loaded: Any, reason: str, what: str) -> bool:
        """Whether every rank's loaded part comes from the same save (collective); every rank
        raises alike when one has no part (``reason`` says why)."""
        with tpdist.agree(what) as agreement:
            if loaded is None:
                raise CheckpointingError(reason)
            agreement.key = str(loaded[0].extra.get("save"))
        return agreement.same

    def _restore_replicas(self, iteration: int, mixed: bool) -> None:
        """Give back the replicas of ``iteration`` that ranks should hold but lack (a replaced node),
        or hold from another save (``mixed``: the load saw copies of more than one save).

        The plan is agreed now (collective, small); the bytes move on a background thread over the
        strategy's restore group while training resumes. :meth:`wait_for_restore` joins it, and so
        does every later collective call of this manager.
        """
        strategy = self.replication
        if strategy is None or strategy.replication_factor < 2:
            return
        what = f"restoring the replicas of local checkpoint iteration {iteration}"
        status = self._status(iteration, True, [])
        _, plan = self._agree_on_plan(status, strategy.holders, what, force=mixed)
        for holder, origin in plan.unreplicated:
            if holder == self.store.rank:
                _warn_unrestored(iteration, origin, "no rank holds a good copy")
        if not plan.moves:
            return
        self._log_plan(iteration, plan, "replica(s) in the background")
        group = strategy.restore_group
        self._restore = threading.Thread(
            target=self._restore_in_background,
            args=(iteration, plan, group),
            name="tierpoint-restore",
        )
        self._restore.start()

    def _agree_on_plan(
        self, status: HolderStatus, holders: Any, what: str, force: bool, **extra: str | None
    ) -> tuple[list[dict[str, Any]], RetrievalPlan]:
        """Every rank's status (with ``extra``: ``reason``, ``kind``) and the retrieval plan each
        rank makes from them alike. Collective. Unless ``force`` (every rank alike), when every
        rank has its own part and every replica it should hold, one all-reduce of a flag says so
        and nothing is gathered (an empty plan, no statuses); otherwise the statuses travel merged
        per node (O(nodes) bytes per rank, see :mod:`tierpoint.local.node_reports`)."""
        if not force and self._nothing_to_plan(status, holders):
            return [], RetrievalPlan([], [], [])
        records = tpdist.gather_by_node(
            {"rank": self.store.rank, **vars(status), **extra},
            node_reports.merge_statuses,
            f"{what}: gathering what is held",
        )
        statuses = node_reports.expand_statuses(records, self.store.world_size)
        plan = plan_retrieval([HolderStatus.from_json(x) for x in statuses], holders)
        return statuses, plan

    def _nothing_to_plan(self, status: HolderStatus, holders: Any) -> bool:
        """Collective: whether no rank lacks its own part or a replica it should hold."""
        complete = status.own_ok and not status.bad_sources
        if complete and holders is not None:
            held = set(status.holds)
            complete = all(
                origin in held
                for origin in range(self.store.world_size)
                if origin != self.store.rank and self.store.rank in holders(origin)
            )
        flag = tpdist.reduce_ints([complete], "min", "agreeing whether anything must be fetched")
        return bool(flag[0])

    def _log_plan(self, iteration: int, plan: RetrievalPlan, what: str) -> None:
        if self.store.rank == 0:
            logger.info(
                "local iteration %d: restoring %d %s: %s",
                iteration,
                len(plan.moves),
                what,
                ", ".join(f"rank {s} -> {d} (part of {o})" for s, d, o in plan.moves),
            )

    def _restore_in_background(self, iteration: int, plan: RetrievalPlan, group: Any) -> None:
        try:
            missing = self._fetch(iteration, plan, group)
        except Exception as e:  # noqa: BLE001 - a background thread: logged, the next save repairs
            logger.warning(
                "restoring replicas of iteration %d failed (the next save replicates anew; call "
                "wait_for_restore() before destroying the process group after a load): %s",
                iteration,
                e,
            )
            return
        for _, origin in missing:
            _warn_unrestored(iteration, origin, "the transfer failed")

    def wait_for_restore(self, timeout: float | None = None) -> None:
        """Wait until the replicas the last :meth:`load` restores in the background are in place
        (failures are logged as warnings; the next save replicates anew). Not collective.

        Call it before destroying the process group right after a load. Raises
        :class:`CheckpointingError` after ``timeout`` seconds (default: the coordination timeout
        plus a minute; the transfers themselves time out before that).
        """
        limit = tpdist.timeout_or(timeout, tpdist.default_timeout().total_seconds() + 60)
        thread = self._restore
        if thread is None:
            return
        thread.join(limit)
        if thread.is_alive():
            raise CheckpointingError(f"restoring replicas did not finish within {limit:g} s")
        self._restore = None

    def _fetch(self, iteration: int, plan: RetrievalPlan, group: Any) -> list[list[int]]:
        """Carry out ``plan``'s moves; return ``[source, origin]`` of the moves to here that failed.

        A move succeeded only if a new file took the destination's name: a corrupt part that a
        failed transfer left in place is not a fetched one.
        """
        rank, self._fetch_error = self.store.rank, ""
        moves = self.store.part_moves(iteration, plan.moves)
        before = {m.dst_path: naming.version_of(m.dst_path) for m in moves if m.dst == rank}
        try:
            self.store.ensure_dir()
        except OSError as e:  # the moves to here fail below (their bytes are drained), not the call
            self._fetch_error = str(e)
            logger.warning(
                "retrieving parts of iteration %d: cannot create %s: %s",
                iteration,
                self.store.directory,
                e,
            )
        try:
            self.store.move_parts(moves, group)
        except CheckpointingError as e:
            self._fetch_error = self._fetch_error or str(e)
            logger.warning("retrieving parts of iteration %d: %s", iteration, e)
        self.store.forget_scans()
        return [
            [m.src, o]
            for m, (_, _, o) in zip(moves, plan.moves)
            if m.dst == rank and naming.version_of(m.dst_path) in (None, before[m.dst_path])
        ]


def _warn_unrestored(iteration: int, origin: int, why: str) -> None:
    logger.warning(
        "iteration %d: could not restore the replica of rank %d's part here (%s; the next save "
        "replicates anew)",
        iteration,
        origin,
        why,
    )
