"""The Checkpointer's errors, and the agreement that raises them alike on every rank.

OLMo-core's callers catch ``FileExistsError`` (a save into a finished step without
``save_overwrite``) and ``FileNotFoundError`` (no checkpoint, no trainer state); tierpoint's callers
catch :class:`~tierpoint.errors.CheckpointingError`. The two classes here are both.

Call order: a collective step runs its local part inside ``with agreed(what):``; if any rank
raised, every rank raises the same error, of the failing ranks' common class when that class is
one of these two or a tierpoint error class. The block must run no collectives of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from .. import dist as tpdist
from ..errors import CheckpointingError, failed_on_ranks


class CheckpointExistsError(CheckpointingError, FileExistsError):
    """The target holds a finished checkpoint (or files that are not a checkpoint's) and
    ``save_overwrite`` is off; nothing was changed."""

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        CheckpointingError.__init__(self, message, failures)

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.failures)


class CheckpointNotFoundError(CheckpointingError, FileNotFoundError):
    """No checkpoint (or no part of one that was asked for) where the caller pointed."""

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        CheckpointingError.__init__(self, message, failures)

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.failures)


_OWN = {c.__name__: c for c in (CheckpointExistsError, CheckpointNotFoundError)}


@contextmanager
def agreed(what: str) -> Iterator[None]:
    """Run the block on every rank; if it raised anywhere, raise the same error on every rank."""
    error: BaseException | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every failure is reported to all ranks
        error = e
    statuses = tpdist.all_gather_json(
        tpdist.failure_status(error), f"{what} (agreeing on the outcome)"
    )
    kinds = {s[0] for s in statuses if s is not None}
    if len(kinds) == 1 and (cls := _OWN.get(next(iter(kinds)))) is not None:
        failures = {rank: s[1] for rank, s in enumerate(statuses) if s is not None}
        raise cls(failed_on_ranks(what, failures), failures) from error
    tpdist.raise_failures(what, statuses, error)
