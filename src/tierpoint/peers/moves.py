"""What moves between peers: a :class:`FileMove` names one file's source and destination, a
:class:`MoveStats` what one :func:`~tierpoint.peers.transfer.move_files` call carried.

Call order: callers build the same list of moves on every rank of a group and pass it to
:func:`~tierpoint.peers.transfer.move_files`. Invariants: both are frozen (shared by every module of
the move).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FileMove:
    """Copy ``src_path`` on global rank ``src`` to ``dst_path`` on global rank ``dst``."""

    src: int
    dst: int
    src_path: str
    dst_path: str
    mode: int = 0o600
    """The received file's permissions (less the umask); a local tier's parts are private."""


@dataclass(frozen=True)
class MoveStats:
    """What this rank sent and received in one :func:`move_files` call."""

    sent_bytes: int
    received_bytes: int
    seconds: float
