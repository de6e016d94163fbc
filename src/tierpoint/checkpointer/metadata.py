"""``.metadata.json``: the file that makes a ``step<N>`` directory a finished checkpoint.

OLMo-core writes ``{"ephemeral": <bool or null>, "version": "<olmo-core version>"}``; tierpoint
writes the same keys plus ``world_size`` (how many ranks saved their trainer state),
``trainer_state`` (``"tierpoint"``: pickle-free part files) and ``save_id`` (a random id of the save,
which each rank's trainer-state file records too, so a file of another save is refused whatever
the directory is called). Unknown keys are ignored, so files of newer OLMo-core versions still
read; checkpoints of older tierpoint versions have no ``save_id``.

Call order: the saver publishes it last (atomically: tmp + fsync + rename, or one PUT) once
everything else is committed on every rank; whoever removes a checkpoint removes it first.

Invariant: the file is untrusted input: size-capped, parsed as JSON only, every known field
type-checked; anything else is a :class:`~tierpoint.errors.CorruptCheckpointError` naming it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import __version__, storage
from ..errors import CorruptCheckpointError

METADATA_FNAME = ".metadata.json"
TIERPOINT_TRAINER_STATE = "tierpoint"
"""``trainer_state`` of checkpoints whose trainer state is in tierpoint's part files."""
MAX_BYTES = 1 << 20
MAX_SAVE_ID = 128
"""The longest ``save_id`` accepted (tierpoint writes 32 hex digits)."""


@dataclass(frozen=True)
class CheckpointMetadata:
    """What ``.metadata.json`` says about its checkpoint."""

    ephemeral: bool | None = None
    version: str = f"tierpoint-{__version__}"
    world_size: int | None = None
    trainer_state: str | None = TIERPOINT_TRAINER_STATE
    save_id: str | None = None

    def to_json(self) -> bytes:
        doc = {
            "ephemeral": self.ephemeral,
            "version": self.version,
            "world_size": self.world_size,
            "trainer_state": self.trainer_state,
            "save_id": self.save_id,
        }
        return json.dumps(doc).encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> CheckpointMetadata:
        if len(data) > MAX_BYTES:
            raise CorruptCheckpointError(where, f"{len(data)} bytes, more than {MAX_BYTES}")
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(where, f"not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(where, f"a JSON {type(doc).__name__}, not an object")
        _check(doc, "ephemeral", (bool, type(None)), where)
        _check(doc, "version", (str, type(None)), where)
        _check(doc, "world_size", (int, type(None)), where)
        _check(doc, "trainer_state", (str, type(None)), where)
        _check(doc, "save_id", (str, type(None)), where)
        save_id = doc.get("save_id")
        if save_id is not None and not 0 < len(save_id) <= MAX_SAVE_ID:
            raise CorruptCheckpointError(where, f"save_id {save_id!r:.60} is not a save's id")
        world = doc.get("world_size")
        if isinstance(world, bool) or (world is not None and not 0 < world < 1 << 24):
            raise CorruptCheckpointError(where, f"world_size {world!r} is not a rank count")
        return cls(
            ephemeral=doc.get("ephemeral"),
            version=doc.get("version") or "",
            world_size=world,
            trainer_state=doc.get("trainer_state"),
            save_id=save_id,
        )


def _check(doc: Mapping[str, Any], key: str, types: tuple[type, ...], where: str) -> None:
    if key in doc and not isinstance(doc[key], types):
        raise CorruptCheckpointError(where, f"{key} is {type(doc[key]).__name__} {doc[key]!r:.60}")


def metadata_path(step_dir: str | os.PathLike) -> str:
    return storage.join(step_dir, METADATA_FNAME)


def read_metadata(
    step_dir: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> CheckpointMetadata:
    """The parsed ``.metadata.json`` of ``step_dir`` (raises if it is missing or damaged)."""
    path = metadata_path(step_dir)
    return CheckpointMetadata.parse(storage.read_bytes(path, storage_options), path)
