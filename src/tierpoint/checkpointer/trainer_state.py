"""Each rank's trainer state: ``train/rank<r>.safetensors``, one pickle-free part file per rank.

OLMo-core ``torch.save``s each rank's trainer state (data-loader position, RNG states, step
counters) to ``train/rank<r>.pt``, so every rank keeps its own values. tierpoint writes the same
per-rank files in its part-file format (:mod:`tierpoint.fileformat`: a JSON skeleton and raw tensor
bytes, checksummed, no pickle); the state may hold what :mod:`tierpoint.tree` stores (dicts, lists,
tuples, scalars, strings, bytes, tensors, numpy values).

Call order: :func:`encode` (before anything is written: unsupported values raise here), then
:func:`write` on every rank with the save's id; on load :func:`read` on every rank, with what
``.metadata.json`` records (the saving world size and the save's id).

Which file a rank loads: its own when the checkpoint records this world size (a missing one is a
:class:`CorruptCheckpointError` naming it: never another rank's state in its place); rank 0's when
it records another world size (rank 0 logs a WARNING); OLMo-core's rule where it records none (its
own run directories): its own if there, else rank 0's.

Invariants:
- A part file appears under its final name only complete (local: dirty name, fsync, rename; object
  stores: one upload of the finished file).
- OLMo-core's ``rank<r>.pt`` pickles are read only when the caller opts in
  (``allow_pickle=True``), and then through ``torch.load(weights_only=True)``: torch's allow-list
  unpickler, the one :class:`tierpoint.dcp.SafeLoadPlanner` uses for a DCP checkpoint's non-tensor
  values, plus numpy's array, scalar and dtype reconstruction (OLMo-core's trainer saves
  ``np.random.get_state()``); a global outside the list stops the load before it is called, with
  an :class:`UnsupportedStateError` naming it. Without the opt-in such a file is refused with an
  error saying how to opt in.
- Each file records the id of its save and its rank (header ``extra``), checked on read against
  ``.metadata.json``'s ``save_id``: a file copied or swapped between ranks or saves is refused, not
  loaded as another's, and a checkpoint loads under any directory name (a symlink, a copy).
  Checkpoints of tierpoint versions before save ids record their step directory's name instead,
  which must then match.
- Every failure names the file.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import tempfile
from collections.abc import Mapping
from typing import Any

from .. import fileformat, storage
from ..dcp.loading import load_weights_only, weights_only_refusal
from ..errors import CheckpointingError, CorruptCheckpointError, UnsupportedStateError
from ..tree import FlatState, flatten

logger = logging.getLogger("tierpoint")

TRAIN_DIR = "train"
EXTENSION = ".safetensors"
PICKLE_EXTENSION = ".pt"


def state_files(step_dir: str, rank: int) -> tuple[str, str]:
    """Rank ``rank``'s trainer-state file in tierpoint's format, and OLMo-core's pickle."""
    base = storage.join(step_dir, TRAIN_DIR, f"rank{int(rank)}")
    return base + EXTENSION, base + PICKLE_EXTENSION


PLAIN_DATA_HINT = (
    "convert it to plain data (dicts, lists, tuples, numbers, strings, bytes, tensors, numpy "
    "values): the Checkpointer stores trainer state without pickle and has no option for other "
    "objects"
)


def encode(state: Any) -> FlatState:
    """``state`` flattened for writing; raises :class:`UnsupportedStateError` naming the key of a
    value that cannot be stored without pickle."""
    if not isinstance(state, Mapping):
        raise UnsupportedStateError("", f"train_state must be a dict, got {type(state).__name__}")
    return flatten(dict(state), hint=PLAIN_DATA_HINT)


def write(
    step_dir: str,
    rank: int,
    flat: FlatState,
    *,
    save_id: str,
    work_dir: str,
    storage_options: Mapping[str, Any] | None = None,
    upload: storage.UploadOptions = storage.DEFAULT_UPLOAD,
) -> None:
    """Write rank ``rank``'s trainer state into ``step_dir``, bound to the save ``save_id``."""
    target = state_files(step_dir, rank)[0]
    extra = binding(step_dir, rank, save_id)
    if storage.is_local(target):
        storage.makedirs(storage.join(step_dir, TRAIN_DIR))
        fileformat.write_flat(storage.local_path(target), flat, extra=extra, mode=0o644)
        return
    with _scratch(work_dir) as tmp:
        fileformat.write_flat(tmp, flat, extra=extra, fsync=False)
        with open(tmp, "rb") as f:
            data = f.read()
    storage.write_file(target, [data], storage_options=storage_options, upload=upload)


def read(
    step_dir: str,
    rank: int,
    *,
    world_size: int,
    saved_world_size: int | None,
    save_id: str | None,
    allow_pickle: bool,
    work_dir: str,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The trainer state rank ``rank`` of ``world_size`` ranks loads from ``step_dir`` (which file:
    see the module docstring); ``saved_world_size`` and ``save_id`` as ``.metadata.json`` records
    them (``None`` where it does not). ``None`` when the checkpoint records no world size and holds
    no trainer state."""
    if saved_world_size is None:
        candidates = list(dict.fromkeys([rank, 0]))
    else:
        candidates = [rank if saved_world_size == world_size else 0]
        if saved_world_size != world_size and rank == 0:
            logger.warning(
                "%s was saved by %d ranks, loaded by %d: every rank gets rank 0's trainer state",
                step_dir,
                saved_world_size,
                world_size,
            )
    for r in candidates:
        ours, pickled = state_files(step_dir, r)
        if storage.exists(ours, storage_options):
            expected = binding(step_dir, r, save_id)
            return _read_part(ours, expected, work_dir, storage_options)
        if storage.exists(pickled, storage_options):
            if not allow_pickle:
                raise CheckpointingError(
                    f"{pickled} is a pickle (OLMo-core's torch.save trainer state): not loaded by "
                    "default. Pass allow_pickled_trainer_state=True to load it through torch's "
                    "weights_only allow-list, or load_trainer_state=False to skip it"
                )
            return _read_pickle(pickled, storage_options)
    if saved_world_size is None:
        return None
    whose = (
        "each rank's own"
        if saved_world_size == world_size
        else f"rank 0's, which each of this job's {world_size} ranks loads"
    )
    raise CorruptCheckpointError(
        state_files(step_dir, candidates[0])[0],
        f"missing; its .metadata.json records a save by {saved_world_size} ranks, so the "
        f"checkpoint must hold {whose} trainer state (load_trainer_state=False skips it)",
    )


def check_binding(url: str, extra: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Raise :class:`CorruptCheckpointError` naming ``url`` unless its header's ``extra`` records
    ``expected`` (:func:`binding`, or a part of it)."""
    if {k: extra.get(k) for k in expected} != dict(expected):
        recorded = {k: v for k, v in extra.items() if k in ("save_id", "step_dir", "rank")}
        raise CorruptCheckpointError(
            url,
            f"it was written as the trainer state of {recorded}, not of {dict(expected)} (a file "
            "copied or swapped between ranks or saves)",
        )


def binding(step_dir: str, rank: int, save_id: str | None) -> dict[str, Any]:
    """What a trainer-state file records of where it belongs: the id of its save (the one
    ``.metadata.json`` records) and its rank; in checkpoints without a save id, its step
    directory's name and rank."""
    if save_id is None:
        return {"step_dir": storage.basename(step_dir), "rank": int(rank)}
    return {"save_id": save_id, "rank": int(rank)}


def _read_part(
    url: str, expected: dict[str, Any], work_dir: str, storage_options: Mapping[str, Any] | None
) -> Any:
    if storage.is_local(url):
        header, tensors = fileformat.read_flat(storage.local_path(url))
    else:
        data = storage.read_bytes(url, storage_options)
        with _scratch(work_dir) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)
            header, tensors = fileformat.read_flat(tmp)
    check_binding(url, header.extra, expected)
    state = fileformat.unflatten_checked(header, tensors)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(url, f"holds a {type(state).__name__}, not a dict")
    return state


def _read_pickle(url: str, storage_options: Mapping[str, Any] | None) -> Any:
    data = storage.read_bytes(url, storage_options)
    try:
        state = load_weights_only(io.BytesIO(data))
    except pickle.UnpicklingError as e:
        refusal = weights_only_refusal(str(e))
        if not re.search(r"global|allowlist", refusal, re.IGNORECASE):
            raise CorruptCheckpointError(url, f"not a torch.save pickle ({refusal})") from None
        raise UnsupportedStateError(
            url,
            f"torch.load(weights_only=True) refused this pickled trainer state: "
            f"{refusal.rstrip('.')}. allow_pickled_trainer_state=True loads containers, numbers, "
            "strings, tensors and numpy arrays; if you trust this file, allow the global it names "
            "with torch.serialization.add_safe_globals([...]) before load, or pass "
            "load_trainer_state=False to skip the trainer state",
        ) from None
    except Exception as e:  # noqa: BLE001 - a file torch cannot read at all is damaged
        reason = weights_only_refusal(str(e))[:300] or type(e).__name__
        raise CorruptCheckpointError(url, f"torch.load could not read it ({reason})") from None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(url, f"holds a {type(state).__name__}, not a dict")
    return state


class _scratch:
    """A temporary file name in ``work_dir`` (removed on exit)."""

    def __init__(self, work_dir: str) -> None:
        os.makedirs(work_dir, exist_ok=True)
        fd, self.path = tempfile.mkstemp(prefix="trainer-state-", suffix=EXTENSION, dir=work_dir)
        os.close(fd)

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc: object) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
