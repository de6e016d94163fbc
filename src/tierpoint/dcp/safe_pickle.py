"""Load a torch DCP ``.metadata`` pickle without running anything the file asks for.

torch writes a checkpoint's ``.metadata`` with ``pickle.dump(Metadata(...))``; ``pickle.load`` on it
would call any function the file names. ``safe_loads(data, what)`` instead runs the restricted
unpickler (:mod:`tierpoint.dcp.restricted_pickle`) with the ``.metadata`` allow-list
(:mod:`tierpoint.dcp.metadata_globals`): the only globals a file may name are the ones torch's own
writers put there, and none of them resolves to a torch class or function: the DCP dataclasses
become record stand-ins that only keep their state, ``torch.Size``, layouts, memory formats,
``WriteItemType`` and ``pathlib`` paths become small checking functions, dtypes are the dtype
objects themselves.

Every other global (``os.system``, ``builtins.eval``, ``getattr``, ``functools.partial``, torch's
tensor rebuild functions, ``torch.load``, ...) stops the load with :class:`CorruptCheckpointError`
naming the file and the global, before anything is called. After the pickle machine stops, the
records are checked field by field (types, known field names, non-negative sizes, chunks inside their
tensor, storage file names that are plain names, non-negative offsets and lengths, no duplicates) and
only then turned into real torch objects (:mod:`tierpoint.dcp.metadata_check`).

Call order: ``safe_loads(data, what)`` -> ``Metadata``. ``what`` names the source in errors. A
checksum seal after the pickle (:mod:`tierpoint.dcp.metadata_seal`) is checked first.

Invariants: every failure is a :class:`CorruptDCPError` naming ``what``; nothing named by the file
is ever imported or called.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CorruptCheckpointError
from .metadata_check import BadField, check_metadata, file_name_problem
from .metadata_globals import METADATA_PICKLE, Refused
from .metadata_seal import SealMismatch, unsealed
from .restricted_pickle import restricted_load


class CorruptDCPError(CorruptCheckpointError):
    """A DCP checkpoint file (``path``) is malformed, truncated, hostile or missing (``reason``).

    Unlike its base class it survives pickling, which torch DCP needs: it gathers every rank's
    exception with ``all_gather_object`` and raises them together as a ``CheckpointException``.
    """

    def __reduce__(self) -> tuple[type, tuple[Any, str]]:
        return type(self), (self.path, self.reason)


def safe_loads(data: bytes, what: str, *, rank_local: bool = False) -> Metadata:
    """The ``Metadata`` pickled in ``data`` (the bytes of a DCP ``.metadata`` file named ``what``).

    Raises :class:`CorruptCheckpointError` (naming ``what`` and the reason) for anything that is not a
    well-formed DCP metadata pickle built only from allowed globals; nothing named by the file is
    ever called. The chunks of each tensor must cover it exactly once, except in a rank-local
    ``__<rank>.metadata`` (``rank_local=True``), which lists only that rank's chunks.
    """
    if not data:
        raise CorruptDCPError(what, "empty file (no DCP metadata)")
    try:
        data, _ = unsealed(data)
    except SealMismatch as e:
        raise CorruptDCPError(what, str(e)) from None
    try:
        root, end = restricted_load(data, METADATA_PICKLE)
    except Refused as e:
        raise CorruptDCPError(what, str(e)) from None
    except MemoryError:
        raise CorruptDCPError(what, "the pickle claims an impossibly large object") from None
    except Exception as e:  # noqa: BLE001 - the pickle machine only ran stand-ins; all are format errors
        raise CorruptDCPError(what, f"not a DCP metadata pickle ({e!r:.200})") from None
    if end != len(data):
        raise CorruptDCPError(what, f"{len(data) - end} stray bytes after the end of the pickle")
    try:
        return check_metadata(root, whole_tensors=not rank_local, budget=len(data))
    except BadField as e:
        raise CorruptDCPError(what, str(e)) from None


__all__ = ["CorruptDCPError", "file_name_problem", "safe_loads"]
