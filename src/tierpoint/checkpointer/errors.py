"""The Checkpointer's errors, kept by class when agreed across ranks.

OLMo-core's callers catch ``FileExistsError`` (a save into a finished step without
``save_overwrite``) and ``FileNotFoundError`` (no checkpoint, no trainer state); tierpoint's callers
catch :class:`~tierpoint.errors.CheckpointingError`. The two classes here are both, and are
registered with :func:`tierpoint.errors.register_agreed`: a collective step runs its local part
inside ``with agreed(what):`` (:func:`tierpoint.dist.agree`), and when the failing ranks all
raised one of them, every rank raises it.
"""

from __future__ import annotations

from ..dist import agree as agreed
from ..errors import CheckpointingError, register_agreed


@register_agreed
class CheckpointExistsError(CheckpointingError, FileExistsError):
    """The target holds a finished checkpoint (or files that are not a checkpoint's) and
    ``save_overwrite`` is off; nothing was changed."""


@register_agreed
class CheckpointNotFoundError(CheckpointingError, FileNotFoundError):
    """No checkpoint (or no part of one that was asked for) where the caller pointed."""


__all__ = ["CheckpointExistsError", "CheckpointNotFoundError", "agreed"]
