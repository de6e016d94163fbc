"""Where a run's checkpoints are and which are finished: OLMo-core's ``step<N>`` layout.

Layout of one checkpoint (written by tierpoint or by OLMo-core)::

    <run>/step<N>/train/rank<r>.safetensors   rank r's trainer state (tierpoint: pickle-free)
    <run>/step<N>/train/rank<r>.pt            ... or OLMo-core's torch.save pickle
    <run>/step<N>/model_and_optim/            a torch DCP checkpoint (.metadata + data files)
    <run>/step<N>/.metadata.json              written last: the commit point

A directory holding a DCP ``.metadata`` directly (model weights, maybe optimizer state, no trainer
state) counts too, as in OLMo-core.

Call order: :func:`find_checkpoints` / :func:`latest_checkpoint` to choose, then the checkpointer
loads; :func:`remove_checkpoint` to retire one. :func:`finished_metadata` is the rule
:func:`find_checkpoints` applies to each step, and says why a step is skipped (``tierpoint ls``
shows it). Nothing here is collective: each caller lists on its own (the seed's classmethods do
the same).

Invariants:
- A step whose ``.metadata.json`` is missing is never returned (a save in flight or interrupted);
  one whose ``.metadata.json`` is damaged is skipped with a WARNING, so an older one is chosen; a
  store that does not answer raises (:class:`~tierpoint.errors.StorageUnavailableError`).
- Removing a checkpoint un-commits it first (``.metadata.json`` goes first), so a crash while
  removing leaves a directory that is not a checkpoint, never a half-removed one that looks whole.
- Steps are yielded in ascending step order (OLMo-core yields them in listing order).
"""

from __future__ import annotations

import logging
import numbers
import os
import posixpath
import re
import shutil
from collections.abc import Iterator, Mapping
from typing import Any

from .. import storage
from ..errors import CheckpointingError, StorageUnavailableError
from .errors import CheckpointNotFoundError
from .metadata import METADATA_FNAME, CheckpointMetadata, read_metadata
from .trainer_state import TRAIN_DIR, state_files

logger = logging.getLogger("tierpoint")

CHECKPOINT_DIR = "step{step}"
MODEL_AND_OPTIM = "model_and_optim"
DCP_METADATA = ".metadata"
_STEP = re.compile(r"^step([0-9]+)$")


def checkpoint_dirname(step: int) -> str:
    """``step<N>``, the name of step ``step``'s directory; ``step`` is any non-negative integer
    (numpy's too, as OLMo-core formats whatever it is given), never a bool or a float."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r:.40}")
    return CHECKPOINT_DIR.format(step=int(step))


def step_of(name: str) -> int | None:
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def normalize(dir: str | os.PathLike) -> str:
    """``dir`` as a path or URL string without a trailing separator (``~`` expanded locally)."""
    text = storage.checkpoint_path(dir, "dir")
    if storage.is_local(text):
        text = os.path.expanduser(storage.local_path(text))
        return text.rstrip("/") or "/"
    return text.rstrip("/")


def parent_of(dir: str) -> str:
    return os.path.dirname(dir) if storage.is_local(dir) else posixpath.dirname(dir)


def dir_is_checkpoint(
    dir: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> bool:
    """Whether ``dir`` is a finished checkpoint (or a bare DCP checkpoint of model weights)."""
    return _missing(normalize(dir), storage_options) is None


def _missing(dir: str, storage_options: Mapping[str, Any] | None) -> str | None:
    """What ``dir`` lacks to be a finished checkpoint (None: nothing)."""
    if storage.exists(storage.join(dir, DCP_METADATA), storage_options):
        return None
    if not storage.exists(storage.join(dir, METADATA_FNAME), storage_options):
        return f"no {METADATA_FNAME}: its save never finished"
    if not storage.exists(storage.join(dir, MODEL_AND_OPTIM, DCP_METADATA), storage_options):
        return f"no {MODEL_AND_OPTIM}/{DCP_METADATA}"
    if not any(storage.exists(p, storage_options) for p in state_files(dir, 0)):
        names = " or ".join(storage.basename(p) for p in state_files(dir, 0))
        return f"no trainer state of rank 0 ({TRAIN_DIR}/{names})"
    return None


def finished_metadata(
    dir: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> CheckpointMetadata | None:
    """The parsed ``.metadata.json`` of the finished checkpoint ``dir`` (None: a bare DCP
    checkpoint without one): the rule :func:`find_checkpoints` applies to each step. Raises
    :class:`CheckpointNotFoundError` naming what is missing when ``dir`` is not a finished
    checkpoint (it is never returned), :class:`~tierpoint.errors.CorruptCheckpointError` when its
    ``.metadata.json`` is damaged (it is skipped with a WARNING)."""
    dir = normalize(dir)
    missing = _missing(dir, storage_options)
    if missing is not None:
        raise CheckpointNotFoundError(f"{dir}: not a finished checkpoint: {missing}")
    if storage.exists(storage.join(dir, METADATA_FNAME), storage_options):
        return read_metadata(dir, storage_options)
    return None


def find_checkpoints(
    dir: str | os.PathLike,
    ephemeral: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Iterator[tuple[int, str]]:
    """``(step, path)`` of each finished checkpoint directly under ``dir``, by ascending step;
    ``ephemeral`` (when not ``None``) keeps only the ephemeral ones or only the others. A local
    ``dir`` that is not a directory raises :class:`CheckpointNotFoundError` (a
    ``FileNotFoundError``), as OLMo-core's listing does; a store's missing prefix lists nothing."""
    dir = normalize(dir)
    if storage.is_local(dir) and not os.path.isdir(storage.local_path(dir)):
        raise CheckpointNotFoundError(f"No such directory: '{dir}'")
    steps = sorted(
        (s, n) for n in storage.listdir(dir, storage_options) if (s := step_of(n)) is not None
    )
    for step, name in steps:
        path = storage.join(dir, name)
        try:
            meta = finished_metadata(path, storage_options)
        except CheckpointNotFoundError:
            continue
        except StorageUnavailableError:
            raise  # the step may be intact: choosing an older one would lose it
        except CheckpointingError as e:
            logger.warning("%s is skipped: %s", path, e)
            continue
        is_ephemeral = bool(meta.ephemeral) if meta is not None else False
        if ephemeral is None or ephemeral == is_ephemeral:
            yield step, path


def latest_checkpoint(
    dir: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> str:
    """The path of the newest finished checkpoint under ``dir``; raises
    :class:`CheckpointNotFoundError` (a ``FileNotFoundError``) when there is none."""
    found = None
    try:
        for _, path in find_checkpoints(dir, storage_options=storage_options):
            found = path
    except CheckpointNotFoundError:  # (only for a local dir that does not exist)
        raise CheckpointNotFoundError(
            f"No checkpoints found in '{normalize(dir)}': no such directory"
        ) from None
    if found is None:
        raise CheckpointNotFoundError(f"No checkpoints found in '{normalize(dir)}'")
    return found


def contains_checkpoint(
    dir: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> bool:
    """Whether ``dir`` is a checkpoint or holds one directly."""
    if dir_is_checkpoint(dir, storage_options):
        return True
    try:
        return next(find_checkpoints(dir, storage_options=storage_options), None) is not None
    except CheckpointNotFoundError:
        return False


def remove_tree(url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Remove ``url`` and everything under it (missing is fine)."""
    try:
        if storage.is_local(url):
            path = storage.local_path(url)
            if os.path.lexists(path):
                shutil.rmtree(path)
                storage.fsync_dir(os.path.dirname(os.path.abspath(path)))
            return
        fs, path = storage.filesystem(url, storage_options)
        fs.invalidate_cache(path)
        if storage.request(f"inspecting {url}", fs, "exists", path):
            storage.request(f"removing {url}", fs, "rm", path, recursive=True)
        fs.invalidate_cache(path)
    except Exception as e:  # noqa: BLE001 - reported with the path
        raise storage.failure("removing", url, e) from e


def remove_checkpoint(path: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Un-commit the checkpoint at ``path`` (``.metadata.json`` first), then remove it all."""
    storage.remove(storage.join(path, METADATA_FNAME), storage_options=storage_options)
    remove_tree(path, storage_options)
