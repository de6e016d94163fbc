"""LocalCheckpointManager: crash-consistent node-local checkpoints with agreed discovery (the
public facade, with NVRx's method and argument names).

Call order (every rank, at the same point of the training loop, as with NVRx)::

    manager = LocalCheckpointManager(root)          # no collective
    iteration = manager.find_latest()               # one collective; -1 when there is none
    if iteration != -1:
        ta_state_dict, ckpt_id = manager.load()     # collective (agrees on success)
    ...
    manager.warm_up(BasicTensorAwareStateDict(state))         # optional, not collective
    manager.save(BasicTensorAwareStateDict(state), iteration)   # collective
    ...
    manager.close()                                  # optional, not collective: frees its memory

The work is done by components over one :class:`~tierpoint.local.store.PartStore` (this rank's
files, and the latest iteration as agreed): :class:`~tierpoint.local.discovery.Discovery`
(``find_latest``), :class:`~tierpoint.local.recovery.PartRecovery` (``load``, peer retrieval,
replica restore) and :class:`~tierpoint.local.saving.PartSaver` (``save``, replication, commit).
This module validates the arguments, keeps NVRx's names (``repl_strategy``, ``ta_state_dict``,
``latest_iteration`` and the helpers of :mod:`~tierpoint.local.nvrx_names`) and orders the calls.

Invariants kept here:
- The background restore of a replaced node's replicas that a load started is joined first by
  every later collective call of the manager.
- The job's world size stays the one the manager first worked with (a save as "rank 0 of 1" after
  the process group was destroyed would retire the distributed checkpoint's parts).
- The latest iteration is cached until a save commits or fails; see the components for the rest
  (complete or invisible, every rank agrees, a load never returns an unverified part).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import peers
from ..asyncsave.request import AsyncRequest
from ..errors import CheckpointingError, check_flag
from ..staging import Stager
from ..tensor_aware import TensorAwareStateDict
from . import naming
from .discovery import Discovery
from .holds import HeldPart, hold_own_part
from .naming import CkptID
from .nvrx_names import NVRxFileNames
from .recovery import LoadRecord, PartRecovery
from .replication import CliqueReplicationStrategy, UserReplication
from .saving import PartSaver
from .store import PartStore


class LocalCheckpointManager(NVRxFileNames):
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
        device_snapshot: an async save first copies the state into a reused buffer on each tensor's
            own device (GPU memory for CUDA tensors, in the training stream's order), so training
            may change the state as soon as ``save`` returns; the copy to host memory runs with the
            snapshot (in the background with ``AsyncCallsQueue(overlap_snapshot=True)``, whose
            ``wait_for_snapshot`` and optimizer hook then need not wait). Costs as much memory on
            each device as the state holds there (see :mod:`tierpoint.device_snapshot`).

    The settings are read-only after construction (the components were made with them).
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
        device_snapshot: bool = False,
    ) -> None:
        if type(keep_last) is not int or keep_last < 1:
            raise CheckpointingError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        for name, value in (
            ("recycle", recycle),
            ("verify", verify),
            ("mmap_load", mmap_load),
            ("device_snapshot", device_snapshot),
        ):
            check_flag(name, value)  # verify=None must not turn checksums off quietly
        root = (
            naming.default_root()
            if root_local_ckpt_dir in (None, "")
            else Path(naming.local_root(root_local_ckpt_dir))
        )
        if ".." in root.parts:
            raise CheckpointingError(f"root_local_ckpt_dir must not contain '..': {root}")
        session_id = naming.validate_session_id(session_id)
        if repl_strategy is None or isinstance(repl_strategy, CliqueReplicationStrategy):
            replication = repl_strategy
        elif UserReplication.accepts(repl_strategy):
            replication = UserReplication(repl_strategy)
        else:
            raise CheckpointingError(
                "repl_strategy must be a CliqueReplicationStrategy, a ReplicationStrategy (with "
                f"NVRx's replicate(local_ckpt, id_)) or None, got {type(repl_strategy).__name__}"
            )
        self._keep_last = keep_last
        self._replication = replication
        self._world: int | None = None  # the world size this manager works with, once known
        self._store = PartStore(root, session_id)
        self._discovery = Discovery(self._store)
        self._recovery = PartRecovery(self._store, replication, verify=verify, mmap_load=mmap_load)
        self._saver = PartSaver(
            self._store,
            replication,
            keep_last=keep_last,
            recycle=recycle,
            device_snapshot=device_snapshot,
        )

    # ------------------------------------------------------------------------------ settings, identity

    @property
    def root_local_ckpt_dir(self) -> Path:
        return self._store.root

    @property
    def session_id(self) -> str:
        return self._store.session_id

    @property
    def repl_strategy(self) -> Any:
        """The replication (NVRx's name): a clique strategy, a user's strategy wrapped, or ``None``."""
        return self._replication

    @property
    def keep_last(self) -> int:
        return self._keep_last

    @property
    def recycle(self) -> bool:
        return self._saver.recycle

    @property
    def verify(self) -> bool:
        return self._recovery.verify

    @property
    def mmap_load(self) -> bool:
        return self._recovery.mmap_load

    @property
    def rank(self) -> int:
        return self._store.rank

    @property
    def world_size(self) -> int:
        return self._store.world_size

    @property
    def local_ckpt_dir(self) -> Path:
        """This rank's directory (NVRx's name)."""
        return self._store.directory

    @property
    def _latest(self) -> int | None:
        """The latest complete iteration as agreed, ``None`` when not known (read by
        :class:`~tierpoint.local.nvrx_names.NVRxFileNames`)."""
        return self._store.latest

    @property
    def last_load(self) -> LoadRecord | None:
        """What the last successful :meth:`load` did (iteration, from peers, bytes, seconds)."""
        return self._recovery.last_load

    @property
    def last_replication(self) -> peers.MoveStats | None:
        """Bytes and seconds of this rank's part of the last replication (for monitoring)."""
        return self._saver.last_replication

    @property
    def _stager(self) -> Stager:
        """The staging memory of async snapshots (tests check whether it is pinned)."""
        return self._saver.stager

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

    # ------------------------------------------------------------------------------ NVRx's calls

    def find_latest(self) -> int:
        """The newest iteration complete on every rank, or -1. Collective; cached until the next save."""
        self.wait_for_restore()
        if self._store.latest is not None:
            return self._store.latest
        self._check_world()
        if self._replication is not None:
            self._replication.setup()  # collective on first use (lazy strategies create their group)
        return self._discovery.find_latest()

    def other_world_parts(self) -> list[tuple[int, int]]:
        """``(iteration, world size)`` of the parts the last :meth:`find_latest` skipped because
        they were saved with another world size (the local tier does not reshard), newest first;
        the same on every rank. Not collective."""
        return self._discovery.other_world_parts()

    def incomplete_parts(self) -> list[tuple[int, str]]:
        """``(iteration, why)`` of each iteration newer than the one the last :meth:`find_latest`
        found (of this world size) that is incomplete, newest first; the same on every rank. Not
        collective."""
        return list(self._discovery.incomplete)

    def unusable_parts(self) -> list[str]:
        """After :meth:`find_latest` returned -1: why the parts found cannot be loaded where they
        show that a checkpoint existed (a whole clique lost, the ranks of a node changed); empty
        when none did. Collective."""
        return self._discovery.unusable()

    def set_aside(self, iteration: int) -> None:
        """Do not resume from ``iteration``, which :meth:`load` returned but the caller cannot use
        (saved in another parallel layout, say): the next save removes it and anything newer
        instead of refusing an older iteration (:meth:`find_latest` still finds it, complete, until
        then). Not collective: call it alike on every rank."""
        self._store.unloadable.add(iteration)
        self._store.latest = None

    def load(self, *, allow_pickle: bool = False) -> tuple[TensorAwareStateDict, CkptID]:
        """Load this rank's part of the latest complete iteration (verified). Collective.

        Missing or corrupt own parts are fetched from their holders first; replicas a replaced node
        should hold are restored in the background after this returns (see :meth:`wait_for_restore`).
        ``allow_pickle``: also load objects saved with ``allow_pickle=True`` (only for trusted files).
        """
        check_flag("allow_pickle", allow_pickle)
        iteration = self.find_latest()
        if iteration == naming.NO_CHECKPOINT:
            raise self._discovery.nothing_complete()
        return self._recovery.load(iteration, self._discovery.older_than, allow_pickle=allow_pickle)

    def wait_for_restore(self, timeout: float | None = None) -> None:
        """Wait until the replicas the last :meth:`load` restores in the background are in place
        (failures are logged as warnings; the next save replicates anew). Not collective.

        Call it before destroying the process group right after a load. Raises
        :class:`CheckpointingError` after ``timeout`` seconds (default: the coordination timeout
        plus a minute; the transfers themselves time out before that).
        """
        self._recovery.wait_for_restore(timeout)

    def warm_up(self, ta_state_dict: TensorAwareStateDict, *, wait: bool = False) -> None:
        """Prepare the first saves of ``ta_state_dict``'s layout ahead of time, in a background
        thread: the staging memory (allocated, its pages faulted in, pinned for CUDA tensors),
        which is the spare files the first saves fill on a RAM tier with recycling, else a
        staging buffer.
        Without it the first saves pay for all of that. Not collective; call it once the state
        has the layout it is saved with (after the first optimizer step creates the optimizer's
        state), well before the first save, which waits for it. ``wait``: return once it is done."""
        if not isinstance(ta_state_dict, TensorAwareStateDict):
            raise CheckpointingError(
                "warm_up expects a TensorAwareStateDict (e.g. BasicTensorAwareStateDict(state)), "
                f"got {type(ta_state_dict).__name__}"
            )
        self.wait_for_restore()  # the restore writes into the tier too
        self._saver.warm_up(ta_state_dict)
        if wait:
            self.wait_for_warm_up()

    def wait_for_warm_up(self, timeout: float | None = None) -> None:
        """Wait until :meth:`warm_up`'s preparation is over (failures are logged as warnings: the
        saves then prepare what they need themselves). Not collective. Raises
        :class:`CheckpointingError` after ``timeout`` seconds (default: the coordination timeout)."""
        error = self._saver.join_warm_up(timeout)
        if error is not None:
            raise error

    def close(self) -> None:
        """Free what the manager keeps for its next saves: the mappings of its part files (each
        pins its file's pages, RAM on a RAM tier, also once the file is removed), the staging
        memory and the device snapshot. Not collective; call it once no async save of this
        manager is in flight (finalized or aborted). Waits for the warm-up and the background
        restore of replicas (they use them). The manager stays usable: the next save prepares
        them again."""
        self.wait_for_restore()
        self.wait_for_warm_up()
        self._saver.stager.close()
        if self._saver.device_snapshot is not None:
            self._saver.device_snapshot.close()
        self._store.mappings.close()

    def save(
        self, ta_state_dict: TensorAwareStateDict, iteration: int, is_async: bool = False
    ) -> AsyncRequest | None:
        """Save this rank's part of ``iteration``. Collective.

        Sync: returns ``None`` once every rank committed. Async: returns an :class:`AsyncRequest` to
        hand to an :class:`~tierpoint.asyncsave.AsyncCallsQueue`; scheduling it snapshots the state into
        reused staging memory and the worker process writes it; the previous checkpoint is retired only
        when the queue finalizes the request on every rank.
        """
        self.wait_for_restore()
        self._check_world()
        try:
            iteration = naming.check_iteration(iteration)
        except CheckpointingError as e:  # raised on every rank by the save's first agreement
            return self._saver.save(ta_state_dict, naming.NO_CHECKPOINT, is_async, refusal=e)
        return self._saver.save(ta_state_dict, iteration, is_async)

    def hold_own_part(self, iteration: int) -> HeldPart:
        """This rank's own committed part of ``iteration``, held for a reader in this process
        (the tiered manager's persistent copy): its state (tensors map the file's pages) and the
        file itself (:attr:`HeldPart.source`, for a worker job). Until :meth:`HeldPart.release`
        the file is never recycled, so its bytes stay as they are (:mod:`tierpoint.local.holds`).
        No collective; :class:`CheckpointingError` when the part is not here."""
        return hold_own_part(self._store, self._recovery, iteration)
