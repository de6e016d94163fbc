"""The Checkpointer's errors, kept by class when agreed across ranks.

OLMo-core's callers catch ``FileExistsError`` (a save into a finished step without
``save_overwrite``) and ``FileNotFoundError`` (no checkpoint, no trainer state); tierpoint's callers
catch :class:`~tierpoint.errors.CheckpointingError`. The two classes here are both, and are
registered with :func:`tierpoint.errors.register_agreed`: a collective step runs its local part
inside ``with agreed(what):`` (:func:`tierpoint.dist.agree`), and when the failing ranks all
raised one of them, every rank raises it. A damaged file stays a
:class:`~tierpoint.errors.CorruptCheckpointError` on every rank, also when a lower layer raised a
subclass that agreement does not keep by name (:class:`tierpoint.dcp.CorruptDCPError`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..dist import agree
from ..errors import CheckpointingError, CorruptCheckpointError, register_agreed


@register_agreed
class CheckpointExistsError(CheckpointingError, FileExistsError):
    """The target holds a finished checkpoint (or files that are not a checkpoint's) and
    ``save_overwrite`` is off; nothing was changed."""


@register_agreed
class CheckpointNotFoundError(CheckpointingError, FileNotFoundError):
    """No checkpoint (or no part of one that was asked for) where the caller pointed."""


@contextmanager
def agreed(what: str) -> Iterator[None]:
    """:func:`tierpoint.dist.agree` around the block (collective: every rank enters it), keeping a
    damaged file's error a :class:`CorruptCheckpointError` whatever subclass the block raised."""
    with agree(what):
        try:
            yield
        except CorruptCheckpointError as e:
            if type(e) is CorruptCheckpointError:
                raise
            raise CorruptCheckpointError(e.path, e.reason) from e


__all__ = ["CheckpointExistsError", "CheckpointNotFoundError", "agreed"]
