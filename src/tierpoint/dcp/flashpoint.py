"""ML Flashpoint's checkpoint loader names, over tierpoint's persistent tier (a thin facade).

For code written against ML Flashpoint's ``MLFlashpointCheckpointLoader``: the same class names,
methods and arguments, each delegating to tierpoint's functions (:mod:`tierpoint.dcp.step_dirs`,
:mod:`~tierpoint.dcp.reader`, :mod:`~tierpoint.dcp.peer_fetch`, :mod:`~tierpoint.peers.transfer`).

Call order of a resume (every rank, collective where noted)::

    loader = DefaultMLFlashpointCheckpointLoader()
    latest = loader.get_latest_complete_checkpoint(CheckpointContainerId(base))  # collective
    if latest is not None:
        metadata = loader.read_metadata(latest)          # as stored: two reads compare equal
        tierpoint.dcp.load(state, latest.data)           # collective

Directories in ML Flashpoint's layout (``step-<N>_ckpt`` with sibling
``step-<N>_ckpt__<local rank>__unfinished`` markers) and in tierpoint's (``step-<N>``) are both
found (see :mod:`tierpoint.dcp.step_dirs`). For a local base directory the latest checkpoint is made
complete on every node first: files a node's ranks need and lack are fetched from the nodes that
hold them (:func:`tierpoint.dcp.peer_fetch.retrieve_missing`), as ML Flashpoint's loader does.

What differs from ML Flashpoint, and why:
- ``checkpoint_object_manager`` and ``replication_manager`` are accepted and not used: tierpoint
  reads files itself and fetches missing ones over its own coordination group.
- Metadata and data go through tierpoint's checked reader (allow-list unpickler, every range and
  checksum verified); ML Flashpoint's own buffer-file records (a pickled header before each
  tensor) are refused by :meth:`DefaultMLFlashpointCheckpointLoader.read_tensor`: no pickle on the
  load path.
- Each wait has tierpoint's timeout (``TIERPOINT_TIMEOUT``), not a fixed 30 s.

ML Flashpoint's hooks for subclasses, ``_get_extra_local_objects`` and
``_get_extra_needed_objects`` (files beside the DCP checkpoint, such as NeMo's ``context/``), are
honoured: when a subclass overrides ``_get_extra_needed_objects``, the latest checkpoint's extra
files are fetched to each node lacking them once its DCP files are complete.
"""

from __future__ import annotations

import abc
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from .. import dist as tpdist
from .. import peers, storage
from ..errors import CheckpointingError, UnsupportedStateError
from .extra_objects import retrieve_extra_objects
from .latest import get_latest_complete_checkpoint
from .peer_fetch import fetch_from_peers
from .reader import Reader
from .step_dirs import METADATA_NAME, complete_checkpoints

logger = logging.getLogger("tierpoint")

_STEP = re.compile(r"^step-([0-9]+)(?:_ckpt)?$")


def default_metadata_object_name() -> str:
    """The name of a checkpoint's DCP metadata object: ``.metadata``."""
    return METADATA_NAME


@dataclass(frozen=True)
class _Location:
    """A path or URL (``data``), checked on construction; usable wherever a path is."""

    data: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", storage.checkpoint_path(self.data, "data"))

    def __str__(self) -> str:
        return self.data

    def __fspath__(self) -> str:
        return self.data


@dataclass(frozen=True)
class CheckpointContainerId(_Location):
    """A checkpoint directory (or a base directory holding them); ``data`` is its path or URL."""

    def get_parent(self) -> CheckpointContainerId:
        return CheckpointContainerId(_parent(self.data))

    @staticmethod
    def parse_version_container_step(name: str) -> int | None:
        """The step of a ``step-<N>_ckpt`` (or ``step-<N>``) name, else ``None``."""
        m = _STEP.match(os.path.basename(str(name).rstrip("/")))
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class CheckpointObjectId(_Location):
    """A file inside a checkpoint directory; ``data`` is its path or URL."""

    @classmethod
    def from_container(
        cls, container: CheckpointContainerId | str, name: str
    ) -> CheckpointObjectId:
        return cls(storage.join(_location(container), name))

    def get_parent(self) -> CheckpointContainerId:
        return CheckpointContainerId(_parent(self.data))


def _location(value: Any) -> str:
    """The path of a container or object id, or of a plain path or URL."""
    if isinstance(value, (CheckpointContainerId, CheckpointObjectId)):
        return value.data
    return storage.checkpoint_path(value, "checkpoint_id")


def _parent(path: str) -> str:
    """The directory holding ``path``: ``.`` for a bare name, ``/`` for a name at the root."""
    head, sep, _ = path.rstrip("/").rpartition("/")
    if not sep:
        return "/" if path.startswith("/") else "."
    return head or "/"


class MLFlashpointCheckpointLoader(abc.ABC):
    """The loader interface of ML Flashpoint: metadata, data and latest-checkpoint discovery."""

    @abc.abstractmethod
    def read_metadata(
        self,
        checkpoint_id: CheckpointContainerId,
        object_name: str = default_metadata_object_name(),
    ) -> Metadata:
        """The metadata stored in ``{checkpoint_id}/{object_name}``."""

    @abc.abstractmethod
    def read_data(
        self,
        checkpoint_object_id: CheckpointObjectId,
        read_items: list[ReadItem],
        planner: LoadPlanner,
        storage_data: dict[Any, _StorageInfo],
    ) -> None:
        """Read ``read_items`` of one data object into ``planner``'s state."""

    @abc.abstractmethod
    def get_latest_complete_checkpoint(
        self, checkpoint_base_container: CheckpointContainerId
    ) -> CheckpointContainerId | None:
        """The newest checkpoint under the base that is complete on every rank, or ``None``."""


class DefaultMLFlashpointCheckpointLoader(MLFlashpointCheckpointLoader):
    """ML Flashpoint's default loader, on tierpoint (see the module docstring).

    Args:
        checkpoint_object_manager, replication_manager: ML Flashpoint's; accepted, not used.
        storage_options: fsspec options for URL bases.
        node_local: fetch what a node lacks from its peers before returning the latest checkpoint
            (default: for local paths, not for URLs).
        all_files: with ``node_local``, every node fetches every data file (for a load in another
            layout than the save's at the same world size; see
            :func:`~tierpoint.dcp.get_latest_complete_checkpoint`).
    """

    def __init__(
        self,
        checkpoint_object_manager: Any = None,
        replication_manager: Any = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        node_local: bool | None = None,
        all_files: bool = False,
    ) -> None:
        self.storage_options = storage.options_dict(storage_options)
        self.node_local = node_local
        self.all_files = all_files
        if checkpoint_object_manager is not None or replication_manager is not None:
            logger.info(
                "DefaultMLFlashpointCheckpointLoader: the object and replication managers are not "
                "used; tierpoint reads and fetches checkpoint files itself"
            )

    def read_metadata(
        self,
        checkpoint_id: CheckpointContainerId | str | os.PathLike,
        object_name: str = default_metadata_object_name(),
    ) -> Metadata:
        reader = Reader(_location(checkpoint_id), storage_options=self.storage_options)
        return reader.stored_metadata(name=object_name)

    def read_data(
        self,
        checkpoint_object_id: CheckpointObjectId | str | os.PathLike,
        read_items: list[ReadItem],
        planner: LoadPlanner,
        storage_data: dict[Any, _StorageInfo],
    ) -> None:
        """Read ``read_items`` (all stored in this object, as ``storage_data`` says) into the state
        ``planner`` was set up with; every item is checked before any is written."""
        location = _location(checkpoint_object_id)
        if storage.is_local(location) and not os.path.exists(storage.local_path(location)):
            raise FileNotFoundError(
                f"checkpoint object {location} does not exist here (get_latest_complete_checkpoint "
                "fetches what a node lacks)"
            )
        name = location.rstrip("/").rpartition("/")[2]
        elsewhere = [
            r.storage_index.fqn
            for r in read_items
            if getattr(storage_data.get(r.storage_index), "relative_path", None) != name
        ]
        if elsewhere:
            raise CheckpointingError(
                f"read_data({location}): items stored in another object or not in storage_data: "
                f"{', '.join(elsewhere[:5])}"
            )
        reader = Reader(_parent(location), storage_options=self.storage_options)
        reader.set_up_storage_reader(reader.read_metadata(), False)
        reader.storage_data = {**reader.storage_data, **storage_data}
        reader.read_data(LoadPlan(list(read_items)), planner).wait()

    def read_tensor(
        self, buffer_slice: IO[bytes], req: ReadItem, use_optimized_loader: bool = False
    ) -> torch.Tensor:
        """The region ``req`` asks for of the ``torch.save`` record in ``buffer_slice`` (loaded
        with ``weights_only=True``). ML Flashpoint's optimized records start with a pickled header
        and are refused."""
        if use_optimized_loader:
            raise UnsupportedStateError(
                req.storage_index.fqn,
                "ML Flashpoint's optimized tensor records hold a pickled header, which tierpoint "
                "does not unpickle; save the checkpoint with tierpoint.dcp.save",
            )
        tensor = torch.load(buffer_slice, map_location="cpu", weights_only=True)
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointingError(f"{req.storage_index.fqn}: the record is not a tensor")
        for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            tensor = tensor.narrow(dim, offset, length)
        return tensor

    def get_latest_complete_checkpoint(
        self, checkpoint_base_container: CheckpointContainerId | str | os.PathLike
    ) -> CheckpointContainerId | None:
        """The newest checkpoint that is committed and unmarked, the same on every rank
        (collective); see the module docstring."""
        base = _location(checkpoint_base_container)
        node_local = storage.is_local(base) if self.node_local is None else self.node_local
        found = get_latest_complete_checkpoint(
            base,
            storage_options=self.storage_options,
            node_local=node_local,
            all_files=self.all_files,
        )
        if found is None:
            return None
        latest = CheckpointContainerId(found)
        hooks = type(self)._get_extra_needed_objects
        if node_local and tpdist.is_distributed() and hooks is not _DEFAULT_EXTRA_NEEDED:
            self._retrieve_extra_objects(latest)  # (a subclass's hooks: same class on every rank)
        return latest

    def _get_extra_local_objects(self, container_path: Path) -> list[CheckpointObjectId | str]:
        """ML Flashpoint's hook for subclasses: files beyond the DCP checkpoint's (a ``context/``
        directory, say) that this rank holds in ``container_path``; absolute, or relative to it.
        Called on every rank after the latest checkpoint was chosen. Default: none."""
        return []

    def _get_extra_needed_objects(
        self,
        checkpoint: CheckpointContainerId,
        available_objects_by_rank: dict[int, list[CheckpointObjectId]],
    ) -> set[str]:
        """ML Flashpoint's hook for subclasses (with :meth:`_get_extra_local_objects`): the extra
        files every node needs (paths, or names relative to ``checkpoint``), given what each rank
        holds (its DCP files and its extra ones). Called on rank 0. Default: none."""
        return set()

    def _retrieve_extra_objects(self, checkpoint: CheckpointContainerId) -> None:
        """Bring the files the subclass's hooks name to every node lacking them
        (:mod:`tierpoint.dcp.extra_objects`; the hooks see rank 0's paths). Collective."""

        def needed(files: dict[int, list[str]]) -> list[str]:
            available = {r: [CheckpointObjectId(p) for p in paths] for r, paths in files.items()}
            return [_location(o) for o in self._get_extra_needed_objects(checkpoint, available)]

        def local(path: Path) -> list[str]:
            return [_location(o) for o in self._get_extra_local_objects(path)]

        retrieve_extra_objects(checkpoint.data, local, needed)

    def get_candidate_checkpoints(
        self, checkpoint_base_container: CheckpointContainerId | str | os.PathLike
    ) -> list[CheckpointContainerId]:
        """Every complete checkpoint under the base, newest first, decided from every rank's
        listing (collective)."""
        base = _location(checkpoint_base_container)
        return [
            CheckpointContainerId(p)
            for p in complete_checkpoints(base, storage_options=self.storage_options)
        ]

    def get_checkpoint_objects_by_rank(
        self, checkpoint_container_id: CheckpointContainerId | str | os.PathLike
    ) -> dict[int, list[CheckpointObjectId]]:
        """The files each rank sees in the checkpoint directory (collective)."""
        container = _location(checkpoint_container_id)
        names, error = None, None
        try:
            names = storage.listdir(container, self.storage_options)
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            error = e
        what = f"listing {container} on every rank"
        tpdist.raise_if_any_failed(what, error)
        views = tpdist.all_gather_json(names, what)
        return {
            rank: [CheckpointObjectId.from_container(container, n) for n in view]
            for rank, view in enumerate(views)
        }

    def retrieve_checkpoint(self, retrieval_plan: Mapping[int, Sequence[tuple[int, str]]]) -> bool:
        """Carry out ``retrieval_plan`` (``{rank: [(source rank, object path), ...]}``, the same
        on every rank): each listed file is copied from its source rank to the same path on the
        rank, verified on receipt (collective). ``True`` when every rank succeeded."""
        moves = [
            peers.FileMove(int(src), int(dst), os.fspath(path), os.fspath(path))
            for dst, items in sorted(retrieval_plan.items())
            for src, path in items
        ]
        try:
            fetch_from_peers(moves, "retrieving checkpoint objects")
        except CheckpointingError as e:
            logger.warning("retrieving checkpoint objects failed: %s", e)
            return False
        return True


_DEFAULT_EXTRA_NEEDED = DefaultMLFlashpointCheckpointLoader._get_extra_needed_objects

__all__ = [
    "CheckpointContainerId",
    "CheckpointObjectId",
    "DefaultMLFlashpointCheckpointLoader",
    "MLFlashpointCheckpointLoader",
    "default_metadata_object_name",
]
