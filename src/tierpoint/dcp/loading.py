"""``tierpoint.dcp.load``: torch DCP load through tierpoint's :class:`Reader`, safe end to end.

``load(state_dict, path)`` is ``torch.distributed.checkpoint.load`` (in place, SPMD, reshards
DTensor / ShardedTensor states saved with another number of ranks), with these differences:

- no planning collectives: torch's default load planning is local to each rank (its global step
  returns the plans unchanged), so with the default planner every rank plans and reads on its own
  and the ranks meet twice (one small all-gather each on tierpoint's coordination group, instead
  of torch's gather and scatter of every plan through rank 0 and its final all-gather): once every
  rank has checked every item it will read (:meth:`Reader.start_read`), so that a damaged or hostile
  file on any rank leaves every rank's state as it was, and at the end, on the outcome; with
  another planner or a ``process_group``, ``dcp.load`` runs as usual (each rank still checks its
  items before writing, but cannot know about the other ranks' files);
- the metadata goes through the allow-list unpickler, and every data item is checked before it is
  read (see :class:`Reader`);
- non-tensor values (stored as ``torch.save`` bytes) are loaded with ``torch.load(weights_only=True)``
  by :class:`SafeLoadPlanner`, where torch's default planner uses ``weights_only=False`` (runs any
  pickled code). Plain Python values, containers, tensors and numpy's arrays, scalars and dtypes
  (``np.random.get_state()``) load; a value that needs arbitrary
  classes is refused with an error naming it. Pass ``planner=DefaultLoadPlanner()`` to trust a
  checkpoint that holds such values;
- a failure on any rank is raised on every rank as one tierpoint error naming each failing rank
  (a :class:`CorruptCheckpointError` when every failing rank found a damaged file), instead of
  torch's ``CheckpointException``.

With ``process_group`` given, agreement is left to torch's collectives on that group (tierpoint's
coordination group spans the whole job).
"""

from __future__ import annotations

import functools
import io
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
from torch.distributed.checkpoint.stateful import Stateful

from ..dist import Agreement, agree, get_rank
from ..errors import (
    CheckpointingError,
    CorruptCheckpointError,
    UnsupportedStateError,
    agreed_error,
    error_text,
    failed_on_ranks,
)
from .metadata_rules import chunks_tile
from .reader import DEFAULT_THREAD_COUNT, PreparedRead, Reader
from .state_dict_saver import require_state_dict
from .step_dirs import checkpoint_id_or_path

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
"""Terminal colour codes torch puts into some messages."""
_TORCH_ADVICE = re.compile(
    r"Weights only load failed|weights_only. set to .False|^\(\d\)|Check the documentation of "
    r"torch.load|Please file an issue|^WeightsUnpickler error:\s*$"
)
"""Lines of torch's weights_only message that are advice, not what was refused."""


def weights_only_refusal(message: str) -> str:
    """What a ``torch.load(weights_only=True)`` message says was refused (the global it names),
    without torch's advice and colours."""
    lines = [line.strip() for line in _ANSI.sub("", message).splitlines()]
    kept = [line for line in lines if line and not _TORCH_ADVICE.search(line)]
    text = " ".join(kept).removeprefix("WeightsUnpickler error: ")
    return text[:600] if text else (lines[0] if lines else "")


def load_weights_only(data: io.BytesIO) -> Any:
    """``torch.load(weights_only=True)`` of ``data`` on CPU, numpy's arrays, scalars and dtypes
    allowed too (``np.random.get_state()`` in a state; torch DCP loads them, unpickling anything)."""
    safe_globals = getattr(torch.serialization, "safe_globals", None)  # (torch 2.5 and later)
    if safe_globals is None:
        return torch.load(data, map_location="cpu", weights_only=True)
    # Only those not allowed already: leaving the block takes away what it added, and the user's
    # own add_safe_globals (numpy's classes, as torch's error advises) must stay.
    allowed = set(torch.serialization.get_safe_globals())
    with safe_globals([g for g in _numpy_globals() if g not in allowed]):
        return torch.load(data, map_location="cpu", weights_only=True)


@functools.cache
def _numpy_globals() -> list[Any]:
    """What ``torch.load(weights_only=True)`` needs to rebuild numpy arrays, scalars and dtypes, under
    numpy 2's names and numpy 1's (``numpy.core``). Each element of an object array still goes
    through the allow-list."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1
        from numpy.core import multiarray  # type: ignore[no-redef]
    dtypes = getattr(np, "dtypes", None)
    dtype_classes = (
        [c for c in vars(dtypes).values() if isinstance(c, type) and issubclass(c, np.dtype)]
        if dtypes is not None
        else []
    )
    return [
        np.ndarray,
        np.dtype,
        *dtype_classes,
        *(
            (getattr(multiarray, name), f"{module}.multiarray.{name}")
            for name in ("_reconstruct", "scalar")
            for module in ("numpy.core", "numpy._core")
        ),
    ]


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner``, except that non-tensor values load with
    ``torch.load(weights_only=True)`` (no pickled code runs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._decoded: dict[str, Any] = {}
        self.refused: list[str] | None = None
        """Set to a list (as :mod:`~tierpoint.dcp.verify` does where checksums proved the bytes
        intact): a value ``weights_only`` refuses is named there and loads as ``None``."""

    def check_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Decode a value before anything is written (:class:`Reader` calls this first)."""
        self._decoded[read_item.dest_index.fqn] = self._decode(read_item, value)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = self._decoded.pop(fqn) if fqn in self._decoded else self._decode(read_item, value)
        if self.flatten_state_dict:
            _set_live(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    def _decode(self, read_item: ReadItem, value: io.BytesIO) -> Any:
        try:
            return load_weights_only(value)
        except Exception as e:  # noqa: BLE001 - whatever torch refuses, we refuse
            if self.refused is not None:
                self.refused.append(read_item.dest_index.fqn)
                return None
            refusal = weights_only_refusal(str(e)).rstrip(". ")
            raise UnsupportedStateError(
                read_item.dest_index.fqn,
                "this non-tensor value needs code from the checkpoint to load (torch.load "
                f"weights_only=True refused it: {refusal}); pass planner=DefaultLoadPlanner() to "
                "trust the whole checkpoint",
            ) from None


def _set_live(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """torch's ``set_element``, except that a dict key is matched by its name (:func:`key_named`):
    torch would add the value under ``"3"`` beside the live key 3, leaving 3 as it was."""
    container: Any = root
    at = 0
    while at < len(path) - 1:
        name = path[at]
        if isinstance(container, Mapping):
            child = container.get(key_named(container, name))
        else:
            child = container[name] if type(name) is int and 0 <= name < len(container) else None
        if not isinstance(child, (Mapping, list)):
            break
        container, at = child, at + 1
    key = key_named(container, path[at]) if isinstance(container, Mapping) else path[at]
    if isinstance(container, Mapping) and at == len(path) - 1:
        container[key] = value
    else:
        set_element(container, (key, *path[at + 1 :]), value)


def key_named(mapping: Mapping[Any, Any], name: Any) -> Any:
    """The key of ``mapping`` torch DCP names ``name``: torch names every key by its ``str`` (the
    int key 3 is ``"3"``); ``name`` itself where it is a key, or where no key is so named."""
    if name in mapping:
        return name
    return next((k for k in mapping if str(k) == str(name)), name)


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike | None = None,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    process_group: Any = None,
    thread_count: int = DEFAULT_THREAD_COUNT,
    planner: LoadPlanner | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Load the DCP checkpoint at ``path`` (a directory or an fsspec URL) into ``state_dict`` in
    place (collective).

    Same contract as ``torch.distributed.checkpoint.load`` (every rank of ``process_group`` calls
    it with the same keys); see the module docstring for what differs. Raises
    :class:`CheckpointingError` (:class:`CorruptCheckpointError` for damaged files) on every rank.
    ``checkpoint_id=`` is torch's name for ``path``. A ``Stateful`` value (a module, a
    torchtitan-style wrapper) is loaded into its ``state_dict()`` and handed back through its
    ``load_state_dict``, as torch does.
    """
    path = checkpoint_id_or_path(path, checkpoint_id, "load")
    require_state_dict(state_dict)
    reader = Reader(path, thread_count=thread_count, storage_options=storage_options)
    if planner is None:
        planner = SafeLoadPlanner()
    if process_group is None and type(planner) is SafeLoadPlanner:
        what = f"loading {os.fspath(path)}"
        read = None
        try:
            # Every rank checks everything it will read before any rank writes into its state.
            with _agreement(what) as agreement:
                read, commit, save_id = _start_without_collectives(state_dict, reader, planner)
                # ranks reading different saves (each looked "the latest" up alone) would mix them
                agreement.key = save_id
            if not agreement.same:
                raise CheckpointingError(
                    f"{what}: the ranks read different saves (their .metadata files record other "
                    "save ids), so the state would mix them; nothing was loaded. Every rank must "
                    "load the same checkpoint: get_latest_complete_checkpoint(base) agrees on one"
                )
            with _agreement(what):
                commit()
        finally:
            if read is not None:
                read.close()
        return
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state_dict,
                storage_reader=reader,
                planner=planner,
                process_group=process_group,
                no_dist=not (dist.is_available() and dist.is_initialized()),
            )
    except CheckpointException as e:
        raise _from_torch(e, os.fspath(path)) from e


def load_here(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    planner: SafeLoadPlanner,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """:func:`load` in this process alone, whether or not a process group exists: no agreement,
    no collectives (:func:`~tierpoint.dcp.verify.verify_checkpoint`'s); errors are this rank's."""
    reader = Reader(path, storage_options=storage_options)
    read = None
    try:
        read, commit, _ = _start_without_collectives(state_dict, reader, planner)
        commit()
    finally:
        if read is not None:
            read.close()


def _save_id(metadata: Any) -> str:
    """The save id torch's and tierpoint's writers record in ``.metadata``."""
    return str(getattr(getattr(metadata, "storage_meta", None), "save_id", None) or "")


@contextmanager
def _agreement(what: str) -> Iterator[Agreement]:
    with agree(what) as agreement:
        try:
            yield agreement
        except CorruptCheckpointError as e:
            # agree() keeps the class only for the classes tierpoint.errors names.
            raise CorruptCheckpointError(e.path, e.reason) from e


def _start_without_collectives(
    state_dict: dict[str, Any], reader: Reader, planner: SafeLoadPlanner
) -> tuple[PreparedRead, Callable[[], None], str]:
    """What ``dcp.load`` does, step for step, minus its collectives: with torch's default load
    planning (every rank plans its own reads; the global step returns the plans unchanged) and this
    reader (no global storage planning), shipping every plan to rank 0 and back changes nothing.
    Everything up to the point where the state is written; the returned function writes it. Also
    returns the save id the ranks compare (:func:`_metadata`)."""
    keys = sorted(state_dict, key=str)  # (int and str keys mix: torch names both as str)
    local = {
        k: state_dict[k].state_dict() if isinstance(state_dict[k], Stateful) else state_dict[k]
        for k in keys
    }
    metadata, save_id = _metadata(reader)
    coordinator = get_rank() == 0
    planner.set_up_planner(local, metadata, coordinator)
    reader.set_up_storage_reader(metadata, coordinator)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
    if save_id is None:
        _require_covered(planner, plan, os.fspath(reader.path))
        save_id = "(rank-local metadata)"
    read = reader.start_read(planner.finish_plan(plan), planner)

    def commit() -> None:
        read.finish()
        for k in keys:
            if isinstance(state_dict[k], Stateful):
                state_dict[k].load_state_dict(local[k])
            else:
                state_dict[k] = local[k]

    return read, commit, save_id


def _metadata(reader: Reader) -> tuple[Any, str | None]:
    """The metadata this rank loads with, and the save id the ranks compare: ``.metadata``, else
    (as torch's ``dcp.load`` does) this rank's ``__<rank>.metadata``, which torch writes when saving
    with ``use_collectives=False``: ``None`` for the save id (each rank's file records its own).
    Neither file: ``.metadata``'s error."""
    try:
        metadata = reader.read_metadata()
    except CheckpointingError as missing:
        if type(missing) is not CheckpointingError:  # damage, a store that does not answer
            raise
        try:
            return reader.read_metadata(rank=get_rank()), None
        except CheckpointingError as e:
            if type(e) is not CheckpointingError:
                raise
            raise missing from None
    return metadata, _save_id(metadata)


def _require_covered(planner: SafeLoadPlanner, plan: LoadPlan, path: str) -> None:
    """A rank-local ``__<rank>.metadata`` lists the chunks this rank saved: each tensor (part) this
    rank loads must be read whole from them, exactly once. torch leaves the rest of it as it was,
    silently (a load in another sharding or world size than the save's)."""
    read: dict[MetadataIndex, list[ChunkStorageMetadata]] = {}
    for item in plan.items:
        if item.type == LoadItemType.TENSOR:
            region = ChunkStorageMetadata(item.dest_offsets, item.lengths)
            read.setdefault(item.dest_index, []).append(region)
    stored = planner.metadata.state_dict_metadata  # (allow_partial_load skips keys not stored)
    for fqn, value in planner.state_dict.items():
        if not isinstance(value, torch.Tensor) or fqn not in stored:
            continue
        for dest in _create_chunk_list(value):
            if not chunks_tile(dest.sizes, read.get(MetadataIndex(fqn, dest.offsets), [])):
                raise CheckpointingError(
                    f"{path} was saved without collectives (one __<rank>.metadata per rank), and "
                    f"the chunks of __{get_rank()}.metadata do not cover the part of {fqn!r} this "
                    f"rank loads ({list(dest.sizes)} at {list(dest.offsets)}) exactly once: the "
                    "rest would keep its old values. Such a checkpoint loads only in the world "
                    "size and sharding of its save"
                )


def _from_torch(e: CheckpointException, path: str) -> CheckpointingError:
    """torch's gathered per-rank failures as one tierpoint error, the same on every rank."""
    failures: dict[int, str] = {}
    errors: list[BaseException] = []
    for rank, wrapped in sorted(e.failures.items()):
        exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        errors.append(exc)
        failures[rank] = error_text(exc)
    kinds = {_kept_class(x) for x in errors}
    kind = kinds.pop() if len(kinds) == 1 else "CheckpointingError"
    return agreed_error(kind, failed_on_ranks(f"loading {path}", failures), failures)


def _kept_class(error: BaseException) -> str:
    """The tierpoint class an agreed error keeps: corrupt files and refused values stay what they are."""
    for cls in (CorruptCheckpointError, UnsupportedStateError):
        if isinstance(error, cls):
            return cls.__name__
    return "CheckpointingError"
