"""Checks of a received file, run as its buckets land: the sender's xxh3-64 digest, or the caller's.

Call order: :func:`~tierpoint.peers.transfer.move_files` makes the checks when it posts a file's
receives, calls ``advance(n)`` each time the first ``n`` bytes are final, and ``finish()`` before the
file is committed (:mod:`tierpoint.peers.receiving`).

Invariants: a check rejects a file by raising a :class:`~tierpoint.errors.CheckpointingError`
naming it; a file once rejected stays rejected (:class:`Rejected`), and its commit fails.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import xxhash

from ..errors import CheckpointingError, CorruptCheckpointError
from .moves import FileMove


def digest(view: memoryview | bytes) -> int:
    """The xxh3-64 of ``view``, shifted to fit an int64 (the trailer a sender posts)."""
    return xxhash.xxh3_64_intdigest(view) - (1 << 63)  # fits an int64


class ReceiveCheck(Protocol):
    """Checks a file while it arrives; made by ``verify(move, data)`` when its receive is posted."""

    def advance(self, available: int) -> None:
        """The first ``available`` bytes of ``data`` are final; raise to reject the file."""

    def finish(self) -> Any:
        """Everything arrived; raise to reject the file."""


class DigestCheck:
    """Running xxh3-64 of the arriving bytes, compared with the sender's trailer at the end."""

    def __init__(self, move: FileMove, data: memoryview) -> None:
        self.move, self._data = move, data
        self._hasher = xxhash.xxh3_64()
        self._done = 0
        self.trailer = torch.zeros(1, dtype=torch.int64)

    def advance(self, available: int) -> None:
        if available > self._done:
            self._hasher.update(self._data[self._done : available])
            self._done = available

    def finish(self) -> None:
        self.advance(len(self._data))
        if self._hasher.intdigest() - (1 << 63) != int(self.trailer[0]):
            raise CorruptCheckpointError(
                self.move.dst_path,
                f"bytes received from rank {self.move.src} do not match its checksum",
            )


class Rejected:
    """Stands in for the checks of a file already rejected while arriving: its commit fails."""

    def __init__(self, error: CheckpointingError) -> None:
        self.error = error

    def advance(self, available: int) -> None:
        pass

    def finish(self) -> None:
        raise self.error
