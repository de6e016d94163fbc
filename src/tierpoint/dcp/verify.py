"""Check a whole DCP checkpoint without a model: every item is read, validated and decoded.

``verify_checkpoint(path)`` reads ``.metadata`` through the allow-list unpickler, then loads every
tensor chunk and non-tensor value it lists into fresh memory with tierpoint's reader (offsets and
lengths checked against the files, archives parsed, values decoded with ``weights_only=True``), a
batch of at most ``batch_bytes`` tensor bytes at a time, each item checked against its recorded
checksum where the checkpoint has checksum manifests (:mod:`tierpoint.dcp.checksums`). Single
process, no collectives; used by ``tierpoint verify DIR``.

Invariants: nothing is written; no code from the checkpoint runs; memory stays near ``batch_bytes``
(plus the largest single tensor); a problem raises :class:`~tierpoint.errors.CheckpointingError`
(:class:`~tierpoint.errors.CorruptCheckpointError` for a damaged file, a checksum mismatch, or a
data file without the manifest the others have) naming the file and the item. A checkpoint with no
manifest at all (written by plain torch) is read just the same and reported unverified. A value
whose bytes match their checksum but that ``weights_only`` refuses (a ``collections.deque``, a
datetime) is intact: it is named in the summary's ``needs_trust``, not raised (without checksums it
cannot be told from damage, and is raised).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .loading import SafeLoadPlanner, load_here
from .reader import Reader
from .safe_pickle import CorruptDCPError


@dataclass(frozen=True)
class CheckpointSummary:
    """What :func:`verify_checkpoint` read."""

    tensors: int
    values: int
    tensor_bytes: int
    verified: bool = False
    """Whether every item was checked against a recorded checksum (False: no manifest)."""
    needs_trust: tuple[str, ...] = ()
    """Intact values the default load refuses (they need code from the checkpoint to load)."""


def verify_checkpoint(
    path: str | os.PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
    batch_bytes: int = 1 << 30,
) -> CheckpointSummary:
    """Read and check every item of the DCP checkpoint at ``path``; see the module docstring."""
    reader = Reader(path, storage_options=storage_options)
    metadata = reader.read_metadata()
    verified = _has_manifests(reader, metadata)
    tensors = values = nbytes = 0
    planner = SafeLoadPlanner()
    planner.refused = [] if verified else None
    for batch in _batches(metadata, batch_bytes):
        load_here(batch, path, storage_options=storage_options, planner=planner)
        for value in batch.values():
            if isinstance(value, torch.Tensor):
                tensors += 1
                nbytes += value.numel() * value.element_size()
            else:
                values += 1
    return CheckpointSummary(tensors, values, nbytes, verified, tuple(planner.refused or ()))


def _has_manifests(reader: Reader, metadata: Metadata) -> bool:
    """Whether every data file has its checksum manifest; none having one is a checkpoint written
    without checksums, some having one is damage (a manifest lost)."""
    files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    without = [name for name in files if reader.manifest(name) is None]
    if without and len(without) < len(files):
        raise CorruptDCPError(
            reader._location(without[0]),
            "no checksum manifest, while other data files of the checkpoint have one",
        )
    return bool(files) and not without


def _batches(metadata: Metadata, batch_bytes: int) -> Iterator[dict[str, Any]]:
    """Flat state dicts of empty destinations for every item, about ``batch_bytes`` each."""
    batch: dict[str, Any] = {}
    size = 0
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            need = math.prod(md.size) * dtype.itemsize
            if batch and size + need > batch_bytes:
                yield batch
                batch, size = {}, 0
            batch[fqn] = torch.empty(tuple(md.size), dtype=dtype)
            size += need
        else:
            batch[fqn] = None  # a non-tensor value: the planner stores what it decodes
    if batch:
        yield batch
