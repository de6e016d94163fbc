"""LocalCheckpointManager: crash-consistent node-local checkpoints with agreed discovery.

Call order (every rank, at the same point of the training loop, as with NVRx)::

    manager = LocalCheckpointManager(root)          # no collective
    iteration = manager.find_latest()               # one collective; -1 when there is none
    if iteration != -1:
        ta_state_dict, ckpt_id = manager.load()     # collective (agrees on success)
    ...
    manager.save(BasicTensorAwareStateDict(state), iteration)   # collective

Invariants kept here:
- Complete or invisible: a part becomes visible by renaming its dirty file after fsync; an iteration
  counts only when every rank's part is visible and its header is valid. The previous complete
  checkpoint is removed only after every rank agreed that the new one is committed. A save first
  removes every rank's leftover parts of its iteration and newer ones (a killed job's, or of an
  iteration this job cannot load) and agrees on that before any rank writes, so no iteration is
  completed by the parts of two saves. A save is refused only below a newer loadable iteration.
- Loading (``load``, ``wait_for_restore``) lives in :mod:`tierpoint.local.recovery`, the base class;
  a load never returns a part that failed verification.
- All ranks agree: the iteration to save, its success or failure (every rank raises the same
  :class:`CheckpointingError` and removes the failed iteration's files), and the latest iteration.
- Recycling: a file no complete checkpoint needs any more becomes a spare (renamed away from its
  committed name first) whose pages the next save rewrites, which is several times faster on tmpfs
  than filling a new file. Spares are never part of any checkpoint.
- The background restore of a replaced node's replicas that a load started is joined first by
  every later collective call of the manager.
- Async snapshots on a RAM tier go straight into the pending part's dirty file (a recycled spare,
  its space reserved before anything is copied) through a mapping kept in ``_mappings`` from save
  to save; only the snapshot of the pending save writes through such a mapping, and the worker only
  seals the file (checksums, header, fsync, rename). On a disk tier, or with CUDA tensors, the
  snapshot goes into a reused memfd staging buffer instead (:mod:`tierpoint.staging`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .. import dist as tpdist
from .. import fileformat, storage, transfer
from ..asyncsave.request import AsyncRequest
from ..errors import CheckpointingError
from ..files import in_memory_filesystem
from ..files import unlink_quietly as _unlink
from ..staging import Stager
from ..tensor_aware import TensorAwareStateDict
from ..tree import FlatState
from . import naming, node_reports
from .jobs import seal_staged_part, write_staged_part
from .nvrx_names import NVRxFileNames
from .recovery import PartRecovery, ReceivedPart
from .replication import CliqueReplicationStrategy, UserReplication

logger = logging.getLogger("tierpoint")


class LocalCheckpointManager(PartRecovery, NVRxFileNames):
    """Saves and restores one part file per rank per iteration under ``root/<session_id>/<rank>/``.

    Args:
        root_local_ckpt_dir: node-local root (default: ``/dev/shm/tierpoint-<uid>``).
        session_id: a name separating different jobs sharing a root.
        repl_strategy: replication across nodes: a :class:`CliqueReplicationStrategy`, or a user's
            strategy with NVRx's ``replicate`` (see :class:`~tierpoint.local.ReplicationStrategy`).
        keep_last: how many complete iterations to keep (the newest ones).
        recycle: reuse the pages of expired part files for new ones (faster; keeps up to one spare
            file per part written per save on disk between saves).
        verify: check every tensor checksum on load.
        mmap_load: load by mapping the part file copy-on-write instead of copying it (no copy, no fresh
            memory; each tensor is backed by its bytes of the mapping). A mapped file is never recycled.
    """

    def __init__(
        self,
        root_local_ckpt_dir: str | os.PathLike | None = None,
        session_id: str = "",
        repl_strategy: Any = None,
        *,
        keep_last: int = 1,
        recycle: bool = True,
        verify: bool = True,
        mmap_load: bool = True,
    ) -> None:
        if type(keep_last) is not int or keep_last < 1:
            raise CheckpointingError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        for name, value in (("recycle", recycle), ("verify", verify), ("mmap_load", mmap_load)):
            if type(value) is not bool:  # verify=None must not turn checksums off quietly
                raise CheckpointingError(f"{name} must be True or False, got {value!r}")
        self.root_local_ckpt_dir = (
            naming.default_root()
            if root_local_ckpt_dir in (None, "")
            else Path(storage.checkpoint_path(root_local_ckpt_dir, "root_local_ckpt_dir"))
        )
        if ".." in self.root_local_ckpt_dir.parts:
            raise CheckpointingError(
                f"root_local_ckpt_dir must not contain '..': {self.root_local_ckpt_dir}"
            )
        self.session_id = naming.validate_session_id(session_id)
        if repl_strategy is None or isinstance(repl_strategy, CliqueReplicationStrategy):
            self.repl_strategy = repl_strategy
        elif UserReplication.accepts(repl_strategy):
            self.repl_strategy = UserReplication(repl_strategy)
        else:
            raise CheckpointingError(
                "repl_strategy must be a CliqueReplicationStrategy, a ReplicationStrategy (with "
                f"NVRx's replicate(local_ckpt, id_)) or None, got {type(repl_strategy).__name__}"
            )
        self.keep_last = keep_last
        self.recycle = recycle
        self.verify = verify
        self.mmap_load = mmap_load
        self._latest: int | None = None
        self._newest_seen: tuple[int, int, int] | None = None
        self._pending: int | None = None
        self._requested: set[int] = set()  # async saves handed out, not yet finalized or aborted
        self._unloadable: set[int] = set()  # complete iterations a load found no good copy of
        self._world: int | None = None  # the world size this manager works with, once known
        self._scan_cache: dict[str, tuple[tuple[int, int, int], list[int] | None]] = {}
        # Every rank's listing as of the last find_latest; None when it decided without them.
        self._listings: list[list[list[int]]] | None = []
        # The iterations complete after this rank's last commit, and its sorted listing then.
        self._after_commit: tuple[frozenset[int], list[list[int]]] | None = None
        self.last_replication: transfer.MoveStats | None = None
        """Bytes and seconds of this rank's part of the last replication (for monitoring)."""
        self._stager = Stager()
        self._mappings = transfer.MappingCache()
        self._restore: threading.Thread | None = None
        self._tier_in_memory: bool | None = None

    # ------------------------------------------------------------------------------ identity, paths

    @property
    def rank(self) -> int:
        return tpdist.get_rank()

    @property
    def world_size(self) -> int:
        return tpdist.get_world_size()

    def _check_world(self) -> None:
        """The job's world size must stay the one this manager started with: after the process group
        was destroyed, a save as "rank 0 of 1" would retire the parts of the distributed checkpoint."""
        current = self.world_size
        if self._world is None:
            self._world = current
        elif current != self._world:
            raise CheckpointingError(
                f"this LocalCheckpointManager works with world size {self._world}, but the job now "
                f"has world size {current} (was the process group destroyed or re-created?): make a "
                "new manager after init_process_group()"
            )

    @property
    def local_ckpt_dir(self) -> Path:
        return self._dir_of(self.rank)

    @property
    def _session_dir(self) -> Path:
        return self.root_local_ckpt_dir / self.session_id

    def _dir_of(self, holder: int) -> Path:
        """Where rank ``holder`` keeps its files (on its own node)."""
        return self._session_dir / str(holder)

    def _part_path(self, iteration: int, origin_rank: int | None = None) -> Path:
        origin = self.rank if origin_rank is None else origin_rank
        return self.local_ckpt_dir / naming.part_name(iteration, origin)

    def _ensure_dir(self) -> None:
        path = self.local_ckpt_dir
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)

    # ------------------------------------------------------------------------------ discovery

    def _scan(self) -> list[list[int]]:
        """This rank's committed, structurally valid parts: ``[iteration, origin rank, world size]``.

        A header is validated once per file version (inode, size, mtime), so saves do not re-read it
        (and an unusable one is warned about once).
        """
        if not self.local_ckpt_dir.is_dir():
            return []
        found = []
        seen: dict[str, tuple[tuple[int, int, int], list[int] | None]] = {}
        for entry in os.scandir(self.local_ckpt_dir):
            parsed = naming.parse_part_name(entry.name)
            if parsed is None:
                continue
            version = naming.file_version(entry.stat())
            cached = self._scan_cache.get(entry.name)
            if cached is not None and cached[0] == version:
                part = cached[1]
            else:  # an unusable file is reported once per version, not on every scan
                part = self._validate_part(entry.path, *parsed)
            seen[entry.name] = (version, part)
            if part is not None:
                found.append(part)
        self._scan_cache = seen
        return found

    def _remember_own_part(self, iteration: int) -> None:
        """Spare the next scan re-reading the header of the part this process just wrote."""
        path = self._part_path(iteration)
        version = naming.version_of(path)
        if version is not None:
            self._scan_cache[path.name] = (version, [iteration, self.rank, self.world_size])

    @staticmethod
    def _validate_part(path: str, iteration: int, origin: int) -> list[int] | None:
        try:
            world = naming.part_world_size(path, iteration, origin)
        except (OSError, CheckpointingError) as e:
            logger.warning("ignoring unusable local part %s: %s", path, e)
            return None
        return [iteration, origin, world]

    @staticmethod
    def _complete_iterations(listings: list[list[list[int]]]) -> dict[int, int]:
        """Iterations whose parts exist for every rank of the world size they were saved with."""
        origins: dict[int, set[int]] = {}
        worlds: dict[int, set[int]] = {}
        for listing in listings:
            for iteration, origin, world in listing:
                origins.setdefault(iteration, set()).add(origin)
                worlds.setdefault(iteration, set()).add(world)
        complete = {}
        for iteration, ranks in origins.items():
            sizes = worlds[iteration]
            if len(sizes) == 1:
                (world,) = sizes
                if ranks >= set(range(world)):
                    complete[iteration] = world
        return complete

    def find_latest(self) -> int:
        """The newest iteration complete on every rank, or -1. Collective; cached until the next save."""
        self.wait_for_restore()
        if self._latest is not None:
            return self._latest
        self._check_world()
        start = time.perf_counter()
        self._setup_replication()
        intact = self._latest_if_intact()
        if intact is not None:
            self._latest, self._listings = intact, None
            self._newest_seen = (intact, self.rank, self.world_size)
            logger.debug("find_latest: %d (%.3f s)", intact, time.perf_counter() - start)
            return intact
        self._listings = self._gather_listings()
        listings = self._listings
        complete = self._complete_iterations(listings)
        usable = [i for i, world in complete.items() if world == self.world_size]
        self._latest = max(usable, default=naming.NO_CHECKPOINT)
        newest = max((tuple(p) for listing in listings for p in listing), default=None)
        self._newest_seen = newest
        if newest is not None and newest[0] > self._latest:
            self._log_unusable(listings)
        if self._latest == naming.NO_CHECKPOINT and not self._holds_parts():
            self._warn_other_ranks_parts()
        logger.debug("find_latest: %d (%.3f s)", self._latest, time.perf_counter() - start)
        return self._latest

    def _gather_listings(self) -> list[list[list[int]]]:
        """Every node's committed parts, one listing per node (collective; origins travel as
        ranges merged by each node's leader: O(nodes) bytes per rank, see
        :mod:`tierpoint.local.node_reports`). A rank that cannot list its directory makes every
        rank raise."""
        what = "find_latest: gathering local checkpoint listings"
        error = None
        try:
            parts = self._scan()
        except (OSError, CheckpointingError) as e:
            parts, error = [], e
        report = {"rank": self.rank, "parts": parts, "error": tpdist.failure_status(error)}
        records = tpdist.gather_by_node(report, node_reports.merge_listings, what)
        statuses: list[Any] = [None] * self.world_size
        for record in records:
            for rank, status in record["errors"].items():
                statuses[int(rank)] = status
        tpdist.raise_failures(what, statuses, error)
        return [node_reports.listing_parts(record) for record in records]

    def _latest_if_intact(self) -> int | None:
        """The newest iteration, when every rank holds its own part of it and no rank holds a newer
        part (one all-reduce of a few integers, O(1) bytes per rank): it is then complete, and the
        newest that is. ``None`` on every rank otherwise: the listings must be gathered."""
        try:
            parts = self._scan()
            readable = True
        except (OSError, CheckpointingError):
            parts, readable = [], False  # the gathered path reports it
        newest = max((p[0] for p in parts), default=naming.NO_CHECKPOINT)
        own = max(
            (i for i, origin, world in parts if origin == self.rank and world == self.world_size),
            default=naming.NO_CHECKPOINT,
        )
        # A part of another world size at the newest iteration makes it ambiguous: gathered.
        one_world = all(world == self.world_size for i, _, world in parts if i == newest)
        low = tpdist.reduce_ints(
            [readable and one_world, own, -own, -newest],
            "min",
            "find_latest: comparing the newest local parts",
        )
        if low[0] == 1 and low[1] >= 0 and low[1] == -low[2] == -low[3]:
            return low[1]
        return None

    def _holds_parts(self) -> bool:
        try:
            return bool(self._scan())
        except (OSError, CheckpointingError):
            return False

    def _warn_other_ranks_parts(self) -> None:
        """Nothing is complete and this rank holds no parts, yet directories of other ranks under
        the same root hold some: typically this node's ranks changed since the save (an elastic
        rendezvous numbers nodes anew), and parts are found by global rank. Said, not acted on: on a
        shared root those directories belong to other nodes' ranks."""
        session = self._session_dir
        try:
            others = sorted(
                int(d.name)
                for d in os.scandir(session)
                if d.name.isdigit()
                and int(d.name) != self.rank
                and any(naming.parse_part_name(n) for n in os.listdir(d.path))
            )
        except OSError:
            return
        if others:
            logger.warning(
                "rank %d holds no local parts under %s, but the directories of rank(s) %s there "
                "do: parts are found by global rank, so if this node's ranks changed since they "
                "were saved (torchrun numbers nodes anew at each rendezvous unless --node-rank is "
                "fixed), those parts are not used",
                self.rank,
                session,
                ", ".join(map(str, others[:8])) + (", ..." if len(others) > 8 else ""),
            )

    def _log_unusable(self, listings: list[list[list[int]]]) -> None:
        """Say why each iteration newer than the latest usable one is not used: saved with another
        world size (the local tier does not reshard), or parts missing everywhere."""
        fallback = (
            f"falling back to iteration {self._latest}"
            if self._latest != naming.NO_CHECKPOINT
            else "no older complete iteration exists"
        )
        for iteration in sorted({p[0] for listing in listings for p in listing}, reverse=True):
            if iteration <= self._latest:
                break
            parts = [p for listing in listings for p in listing if p[0] == iteration]
            worlds = {p[2] for p in parts}
            if worlds != {self.world_size}:
                logger.warning(
                    "local iteration %d was saved with world size %s, this job has %d ranks: the "
                    "local tier does not reshard (a persistent DCP checkpoint does); %s",
                    iteration,
                    "/".join(map(str, sorted(worlds))),
                    self.world_size,
                    fallback,
                )
                continue
            missing = sorted(set(range(self.world_size)) - {p[1] for p in parts})
            logger.warning(
                "local iteration %d is incomplete: no copy of the part%s of rank%s %s anywhere "
                "(an interrupted save, or more members of a replication clique lost than replicas "
                "exist); %s",
                iteration,
                "s" if len(missing) > 1 else "",
                "s" if len(missing) > 1 else "",
                ", ".join(map(str, missing)),
                fallback,
            )

    def _gather_parts(self, what: str, payload: dict[str, Any], create: bool = False) -> list[Any]:
        """Every rank's ``payload`` with its committed parts (``"parts"``, see :meth:`_scan`); a rank
        that cannot list (or, with ``create``, create) its directory makes every rank raise."""
        error = None
        try:
            if create:
                self._ensure_dir()
            parts = self._scan()
        except (OSError, CheckpointingError) as e:
            parts, error = [], e
        gathered = tpdist.all_gather_json(
            {**payload, "parts": parts, "error": tpdist.failure_status(error)}, what
        )
        tpdist.raise_failures(what, [g["error"] for g in gathered], error)
        return gathered

    def _setup_replication(self) -> None:
        """Collective on first use (lazy strategies create their group here)."""
        if self.repl_strategy is not None:
            self.repl_strategy.setup()

    def _replicate(self, iteration: int, written: bool) -> None:
        """Send this rank's part to its clique and receive the clique's parts (collective).

        ``written`` False: this rank's own write failed; its peers learn it at once.
        """
        strategy = self.repl_strategy
        if strategy is None or strategy.replication_factor < 2:
            return
        start = time.perf_counter()
        moves = self._part_moves(
            iteration,
            [(o, h, o) for o in range(self.world_size) for h in strategy.holders(o)],
        )
        stats = transfer.move_files(
            moves,
            strategy.group,
            timeout=tpdist.default_timeout().total_seconds(),
            digest=False,  # the part file carries its own checksums, verified on receipt
            verify=ReceivedPart,
            unavailable=None if written else f"rank {self.rank} could not write its own part",
            reuse=lambda move: self._take_spare(leftovers=False) if self.recycle else None,
            mappings=self._mappings,
        )
        self.last_replication = stats
        logger.debug(
            "replicated iteration %d: sent %d, received %d bytes in %.3f s",
            iteration,
            stats.sent_bytes,
            stats.received_bytes,
            time.perf_counter() - start,
        )

    def _replicate_with_user_strategy(
        self, ta_state_dict: TensorAwareStateDict, iteration: int
    ) -> None:
        """Run the user's ``replicate`` (collective) and write what it gives this rank to keep as
        replica parts."""
        assert isinstance(self.repl_strategy, UserReplication)
        for ckpt, (saved, origin, session) in self.repl_strategy.replicate(
            ta_state_dict, self._ckpt_id(iteration)
        ):
            if origin == self.rank:
                continue
            if (
                saved != iteration
                or session != self.session_id
                or type(origin) is not int
                or not 0 <= origin < self.world_size
            ):
                raise CheckpointingError(
                    f"{type(self.repl_strategy.strategy).__name__}.replicate returned a checkpoint "
                    f"of {(saved, origin, session)} while saving {self._ckpt_id(iteration)}"
                )
            flat = ckpt.to_flat()
            extra = {**self._extra(iteration), "rank": origin}
            path = self._part_path(iteration, origin)
            fileformat.write_flat(path, flat, plan=fileformat.plan_part(flat, extra))

    # ------------------------------------------------------------------------------ saving

    def save(
        self, ta_state_dict: TensorAwareStateDict, iteration: int, is_async: bool = False
    ) -> AsyncRequest | None:
        """Save this rank's part of ``iteration``. Collective.

        Sync: returns ``None`` once every rank committed. Async: returns an :class:`AsyncRequest` to
        hand to an :class:`~tierpoint.asyncsave.AsyncCallsQueue`; scheduling it snapshots the state into
        reused staging memory and the worker process writes it; the previous checkpoint is retired only
        when the queue finalizes the request on every rank.
        """
        iteration = naming.check_iteration(iteration)
        self.wait_for_restore()
        self._check_world()
        if not isinstance(ta_state_dict, TensorAwareStateDict):
            raise CheckpointingError(
                f"save expects a TensorAwareStateDict (e.g. BasicTensorAwareStateDict(state)), got {type(ta_state_dict).__name__}"
            )
        if self._pending is not None and not is_async:
            raise CheckpointingError(
                f"the async save of iteration {self._pending} is not finalized yet: call "
                "AsyncCallsQueue.maybe_finalize_async_calls(blocking=True) before a sync save"
            )
        start = time.perf_counter()
        self._setup_replication()
        keep = self._agree_on_iteration(iteration)
        logger.debug("save %d: iteration agreed in %.3f s", iteration, time.perf_counter() - start)
        try:
            with tpdist.agree(f"saving local checkpoint iteration {iteration}"):
                # Before any rank writes (this agreement is the barrier): a part of this iteration
                # left by a killed job would complete it together with another rank's new part.
                self._remove_leftovers(iteration)
                flat = ta_state_dict.to_flat()
                plan = fileformat.plan_part(flat, self._extra(iteration))
            if not is_async:
                with tpdist.agree(f"writing local checkpoint iteration {iteration}"):
                    self._write_part(flat, plan, iteration)
            user_strategy = isinstance(self.repl_strategy, UserReplication)
            if self.repl_strategy is not None and (user_strategy or not is_async):
                with tpdist.agree(f"replicating local checkpoint iteration {iteration}"):
                    if user_strategy:  # as NVRx: in the training process, also for async saves
                        self._replicate_with_user_strategy(ta_state_dict, iteration)
                    else:
                        self._replicate(iteration, written=True)
        except CheckpointingError:
            self._abort_iteration(iteration)
            raise
        if not is_async:
            logger.debug(
                "save %d: written and agreed after %.3f s", iteration, time.perf_counter() - start
            )
            self._commit(iteration, keep, plan.data_size, start)
            return None
        self._requested.add(iteration)
        return self._async_request(flat, plan, iteration, keep)

    def read_own_part(self, iteration: int) -> Any:
        """This rank's own committed part of ``iteration``, as saved (tensors map the file's pages,
        nothing is copied; no collective, no peer fetch). For a caller that saved it in this process
        (the tiered manager builds its persistent copy from it). Raises :class:`CheckpointingError`
        when the part is not here."""
        loaded, reason, _ = self._read_own(iteration, allow_pickle=False, verify=False)
        if loaded is None:
            raise CheckpointingError(reason)
        header, tensors = loaded
        return fileformat.unflatten_checked(header, tensors)

    def _extra(self, iteration: int) -> dict[str, Any]:
        return {
            "iteration": iteration,
            "rank": self.rank,
            "world_size": self.world_size,
            "session_id": self.session_id,
        }

    def _commit(self, iteration: int, keep: set[int], nbytes: int, start: float) -> None:
        """Every rank committed ``iteration``: make it the latest and retire what is not kept.

        ``keep`` was chosen when the save was requested; an async save committed since then (the
        previous one, finalized in between) is newer than all of it and counts towards ``keep_last``.
        """
        if self._latest is not None and self._latest < iteration:
            keep = set(sorted(keep | {self._latest}, reverse=True)[: self.keep_last - 1])
        self._pending = None
        self._requested.discard(iteration)
        self._latest = iteration
        self._after_commit = None
        self._retire(keep | {iteration})
        self._remember_own_part(iteration)
        with contextlib.suppress(OSError, CheckpointingError):  # else the next save gathers
            self._after_commit = (frozenset(keep | {iteration}), sorted(self._scan()))
        tpdist.log_progress(
            f"saved local checkpoint iteration {iteration} (rank {self.rank})", nbytes, start
        )

    def _abort_iteration(self, iteration: int) -> None:
        self._after_commit = None
        if self._pending == iteration:
            self._pending = None
        self._requested.discard(iteration)
        self._remove_iteration(iteration)
        self._latest = None
        if self.repl_strategy is not None:
            # Every rank aborts alike, so every rank replaces the group (a timed-out exchange may
            # have left messages in flight on the old one).
            self.repl_strategy.reset()

    def _async_request(
        self, flat: FlatState, plan: fileformat.PartPlan, iteration: int, keep: set[int]
    ) -> AsyncRequest:
        path = self._part_path(iteration)
        start = time.perf_counter()
        in_place = self._snapshots_in_place(flat)
        if in_place:
            self._stager.close()  # the part files are the staging memory now

        def snapshot() -> dict[str, Any]:
            # Runs when the queue schedules the request: after the previous save was finalized, so
            # the staging buffer and the spare file are free (refused otherwise, alike on every rank).
            if self._pending is not None:
                self._requested.discard(iteration)
                raise CheckpointingError(
                    f"the async save of local iteration {iteration} was scheduled while the one of "
                    f"iteration {self._pending} is still in flight: nothing written (the local tier "
                    "keeps one async save in flight; use AsyncCallsQueue(max_in_flight=1), the "
                    "default)"
                )
            if self._latest is not None and self._latest >= iteration:  # alike on every rank
                self._requested.discard(iteration)
                raise CheckpointingError(
                    f"the async save of local iteration {iteration} was scheduled after iteration "
                    f"{self._latest} was saved: nothing written (a stale request would retire "
                    "the newer checkpoint)"
                )
            self._pending = iteration
            spare = self._take_spare() if self.recycle else None
            t0 = time.perf_counter()
            # Off the training thread (an overlapped snapshot), hashing each piece just copied costs
            # little more than the copy and spares the worker a pass over the memory; on it, the
            # copy alone is what training waits for.
            hash_now = threading.current_thread() is not threading.main_thread()
            if in_place:
                kwargs = {"checksums": self._stage_in_place(flat, plan, path, spare, hash_now)}
            else:
                buffer, checksums = (
                    self._stager.stage_and_hash(flat, plan)
                    if hash_now
                    else (self._stager.stage(flat, plan), None)
                )
                recycle = str(spare) if spare else None
                kwargs = {"buffer": buffer, "checksums": checksums, "recycle": recycle}
            logger.debug("snapshot of iteration %d: %.3f s", iteration, time.perf_counter() - t0)
            return kwargs

        return AsyncRequest(
            seal_staged_part if in_place else write_staged_part,
            (str(path), plan.to_json()),
            [lambda: self._commit(iteration, keep, plan.data_size, start)],
            preload_fn=snapshot,
            abort_fns=[lambda: self._abort_iteration(iteration)],
            description=f"async save of local checkpoint iteration {iteration}",
            background_fn=None
            if self.repl_strategy is None or isinstance(self.repl_strategy, UserReplication)
            else lambda written: self._replicate(iteration, written),
        )

    def _snapshots_in_place(self, flat: FlatState) -> bool:
        """Whether an async snapshot goes straight into the part file's pages: the tier is in RAM
        (so those pages are shared memory, as a staging buffer is), spares are recycled (so the
        pages exist already and are reused) and every tensor is on the CPU."""
        if self._tier_in_memory is None:  # decided once: the tier does not change file system
            self._tier_in_memory = in_memory_filesystem(self.local_ckpt_dir)
        return (
            self.recycle
            and self._tier_in_memory
            and all(t.device.type == "cpu" for t in flat.tensors)
        )

    def _stage_in_place(
        self,
        flat: FlatState,
        plan: fileformat.PartPlan,
        path: Path,
        spare: Path | None,
        hash_now: bool,
    ) -> list[str] | None:
        """Copy ``flat`` into the data section of ``path``'s dirty file (the spare's pages when
        there is one) through a mapping kept from save to save; the worker then seals it."""
        dirty = fileformat.dirty_name(path)
        size = fileformat.prepare_planned(dirty, plan, recycle=spare)
        mapped = self._mappings.map(str(dirty), size, writable=True)[1]
        data = mapped[plan.data_start() : plan.data_start() + plan.data_size]
        return self._stager.stage_into(flat, plan, data, hash=hash_now)

    def _agree_on_iteration(self, iteration: int) -> set[int]:
        """Check (on every rank alike) that all ranks save the same, new iteration; return what to keep.

        The common case is one all-reduce of a few integers (:meth:`_agree_unchanged`); listings are
        gathered only when some rank's directory changed since the last commit."""
        keep = self._agree_unchanged(iteration)
        if keep is not None:
            return keep
        gathered = self._gather_parts(
            "save: agreeing on the iteration",
            {
                "iteration": iteration,
                "requested": max(self._requested, default=naming.NO_CHECKPOINT),
                "unloadable": sorted(self._unloadable),
            },
            create=True,
        )
        requested = [g["iteration"] for g in gathered]
        if len(set(requested)) != 1:
            raise CheckpointingError(
                f"ranks disagree on the iteration to save: {dict(enumerate(requested))}"
            )
        unloadable = {i for g in gathered for i in g["unloadable"]}
        complete = {
            i: world
            for i, world in self._complete_iterations([g["parts"] for g in gathered]).items()
            if world == self.world_size and i not in unloadable
        }
        keep = self._keep_for(iteration, complete, max(g["requested"] for g in gathered))
        superseded = sorted({p[0] for g in gathered for p in g["parts"] if p[0] >= iteration})
        if superseded and self.rank == 0:
            logger.warning(
                "saving local iteration %d removes iteration(s) %s, which this job cannot load "
                "(saved with another world size, incomplete, or without a good copy of some part)",
                iteration,
                ", ".join(map(str, superseded)),
            )
        return keep

    def _keep_for(self, iteration: int, complete: Iterable[int], in_flight: int) -> set[int]:
        """The complete iterations to keep when saving ``iteration`` (``keep_last`` counts it);
        refuses an iteration that is not newer than every complete one and than ``in_flight``
        (the newest async save requested on any rank and not finalized)."""
        latest = max(complete, default=naming.NO_CHECKPOINT)
        if iteration <= latest:
            raise CheckpointingError(
                f"cannot save iteration {iteration}: iteration {latest} is already saved and iterations must increase"
            )
        if iteration <= in_flight:
            raise CheckpointingError(
                f"cannot save iteration {iteration}: an async save of iteration {in_flight} was "
                "requested and is not finalized; iterations must increase"
            )
        older = sorted((i for i in complete if i < iteration), reverse=True)
        return set(older[: self.keep_last - 1])

    def _agree_unchanged(self, iteration: int) -> set[int] | None:
        """What to keep when saving ``iteration``, agreed by one all-reduce (O(1) bytes per rank),
        if every rank's committed parts are as its last commit left them and every rank knows the
        same complete iterations; ``None`` (listings must be gathered) otherwise, on every rank.

        The all-reduce also carries the requested iteration (equal on every rank) and the newest
        async save still in flight, so the same refusals as with gathered listings follow."""
        known = self._after_commit
        unchanged = known is not None and not self._unloadable
        if unchanged:
            try:
                self._ensure_dir()
                unchanged = sorted(self._scan()) == known[1]
            except (OSError, CheckpointingError):
                unchanged = False  # the gathered path reports it
        complete = sorted(known[0]) if known is not None and unchanged else []
        digest = zlib.crc32(json.dumps(complete).encode()) & 0x7FFFFFFF
        in_flight = max(self._requested, default=naming.NO_CHECKPOINT)
        low = tpdist.reduce_ints(
            [unchanged, iteration, -iteration, digest, -digest, -in_flight],
            "min",
            "save: agreeing on the iteration",
        )
        if not (low[0] == 1 and low[1] == -low[2] and low[3] == -low[4]):
            return None
        return self._keep_for(iteration, complete, -low[5])

    def _remove_leftovers(self, iteration: int) -> None:
        """Remove this rank's parts (own and replicas) of ``iteration`` and newer iterations: once
        ``iteration`` is agreed, such parts belong to no iteration this job can load (a save that
        never completed, another world size, a part with no good copy left). A part that cannot be
        removed fails the save."""
        removed = False
        for entry, saved in self._part_files():
            if saved >= iteration:
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass
                removed = True
        if removed:
            fileformat.fsync_dir(self.local_ckpt_dir)
            self._forget_removed_files()

    def _part_files(self, dirty: bool = False) -> Iterator[tuple[os.DirEntry, int]]:
        """This rank's part files (own and replicas; with ``dirty``, unfinished ones too) and the
        iteration of each."""
        for entry in os.scandir(self.local_ckpt_dir):
            name = entry.name.removesuffix(naming.DIRTY_SUFFIX) if dirty else entry.name
            parsed = naming.parse_part_name(name)
            if parsed is not None:
                yield entry, parsed[0]

    def _write_part(self, flat: FlatState, plan: fileformat.PartPlan, iteration: int) -> None:
        path = self._part_path(iteration)
        spare = self._take_spare() if self.recycle else None
        result = fileformat.write_flat(path, flat, plan=plan, recycle=spare)
        logger.debug(
            "wrote %s (%d bytes, %.3f s, %s)",
            path,
            result.nbytes,
            result.seconds,
            "recycled" if spare else "new",
        )

    def _take_spare(self, leftovers: bool = True) -> Path | None:
        """A file whose pages a new file may reuse: a spare, or (``leftovers``) a stale dirty file."""
        for entry in os.scandir(self.local_ckpt_dir):
            reusable = naming.is_spare_name(entry.name) or (
                leftovers and naming.is_dirty_name(entry.name)
            )
            if reusable and not fileformat.is_mapped(entry.path):
                return Path(entry.path)
        return None

    def _retire(self, keep: set[int]) -> None:
        """Remove (or keep as spares) every own file that no kept iteration needs."""
        spares = [e.name for e in os.scandir(self.local_ckpt_dir) if naming.is_spare_name(e.name)]
        copies = self.repl_strategy.replication_factor if self.repl_strategy is not None else 1
        max_spares = copies if self.recycle else 0
        for entry in sorted(os.scandir(self.local_ckpt_dir), key=lambda e: e.name):
            parsed = naming.parse_part_name(entry.name)
            stale = naming.is_dirty_name(entry.name) or (
                parsed is not None and parsed[0] not in keep
            )
            if not stale:
                continue
            if len(spares) < max_spares and not fileformat.is_mapped(entry.path):
                spare = naming.spare_name(len(spares))
                os.replace(entry.path, self.local_ckpt_dir / spare)
                spares.append(spare)
            else:
                _unlink(entry.path)
        fileformat.fsync_dir(self.local_ckpt_dir)
        self._forget_removed_files()

    def _forget_removed_files(self) -> None:
        """Unmap the files replication mapped that no longer exist (a mapping pins their pages)."""
        if len(self._mappings):
            try:
                present = [e.path for e in os.scandir(self.local_ckpt_dir)]
            except OSError:
                present = []
            self._mappings.retain(present)

    def _remove_iteration(self, iteration: int) -> None:
        if not self.local_ckpt_dir.is_dir():
            return
        for entry, saved in self._part_files(dirty=True):
            if saved == iteration:
                _unlink(entry.path)
        self._forget_removed_files()
