"""The former module of peer file moves, kept as a thin re-export of :mod:`tierpoint.peers`.

The move protocol now lives in :mod:`tierpoint.peers` (:mod:`tierpoint.peers.transfer` and the
modules beside it). This module stays so that the local tier's modules (``from .. import
transfer``, then ``transfer.move_files(...)``) and the tests that replace
``tierpoint.transfer.move_files`` in a rank process need no change while local/ is being split;
new code imports from :mod:`tierpoint.peers`.

Call order and invariants: those of :mod:`tierpoint.peers.transfer`.
"""

from __future__ import annotations

from .peers import (
    DEFAULT_BUCKET_BYTES,
    FileMove,
    MappingCache,
    MoveStats,
    ReceiveCheck,
    move_files,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "FileMove",
    "MappingCache",
    "MoveStats",
    "ReceiveCheck",
    "move_files",
]
