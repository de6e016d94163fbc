"""Peers: whole files moved between ranks over torch.distributed, bucketed, verified on receipt and
committed atomically.

Modules: :mod:`~.transfer` (:func:`move_files`, the move protocol), :mod:`~.buckets` (the messages
and their tags), :mod:`~.checks` (checks of a file as it arrives), :mod:`~.receiving` (the dirty
file and its atomic commit), :mod:`~.mapping_cache` (file mappings, kept across calls),
:mod:`~.moves` (:class:`FileMove`, :class:`MoveStats`).

Invariants: this package knows no checkpoint format and no tier; it imports only the ground floor
(:mod:`tierpoint.errors`, :mod:`tierpoint.files`).
"""

from .buckets import DEFAULT_BUCKET_BYTES
from .checks import ReceiveCheck
from .mapping_cache import MappingCache
from .moves import FileMove, MoveStats
from .transfer import move_files

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "FileMove",
    "MappingCache",
    "MoveStats",
    "ReceiveCheck",
    "move_files",
]
