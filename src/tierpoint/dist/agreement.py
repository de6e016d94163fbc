"""Failure agreement: when a step failed on any rank, every rank raises the same error.

Call order: :func:`agree_on_settings` where every rank must have been given the same settings;
``with agree(what):`` around a block without collectives of its own (every rank enters
it; the block may set the yielded :class:`Agreement`'s ``key``, compared across ranks in the same
all-reduce); or :func:`raise_if_any_failed` with this rank's error; or, where the statuses travel inside a
gather that runs anyway, :func:`failure_status` on each rank and :func:`raise_failures` on the
gathered list.

Invariants: one all-reduce of a flag when no rank failed (texts are gathered only when some rank
failed); the error names each failing rank and its message, and its class is the failing ranks'
common tierpoint class (e.g. :class:`CorruptCheckpointError`) when they all raised one, else
:class:`CheckpointingError`.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointingError, agreed_error, error_text, failed_on_ranks
from .messages import all_gather_json, reduce_ints

_MAX_MESSAGE = 2000


def raise_if_any_failed(
    what: str, error: BaseException | str | None, group: Any = None, value: int = 0
) -> bool:
    """Collective: if any rank passes an error, every rank raises the same :class:`CheckpointingError`.

    One all-reduce of a flag when no rank failed; only then are the failures' texts gathered.
    Returns whether every rank passed the same ``value`` (a non-negative int), compared in that
    all-reduce."""
    what_agreed = f"{what} (agreeing on the outcome)"
    failed, high, low = reduce_ints([error is not None, value, -value], "max", what_agreed, group)
    if failed:
        raise_failures(what, all_gather_json(failure_status(error), what_agreed, group), error)
    return high == -low


def agree_on_settings(what: str, settings: dict[str, Any]) -> None:
    """Collective: raise the same :class:`CheckpointingError` on every rank when ranks were given
    different ``settings`` (JSON values), naming each setting that differs and its value on every
    rank. One all-reduce when they agree; the settings are gathered only when they do not."""
    text = json.dumps(settings, sort_keys=True, default=repr)
    if raise_if_any_failed(what, None, value=zlib.crc32(text.encode()) & 0x7FFFFFFF):
        return
    gathered = [json.loads(g) for g in all_gather_json(text, what)]
    differ = [k for k in settings if len({json.dumps(g.get(k)) for g in gathered}) > 1]
    detail = "; ".join(f"{k} {dict(enumerate(g.get(k) for g in gathered))}" for k in differ)
    raise CheckpointingError(f"{what}: every rank must be given the same settings, got {detail}")


@dataclass
class Agreement:
    """What ``with agree(what) as agreement`` compares besides failures: the block sets ``key``
    (e.g. the id of the save it read); after the block, ``same`` says whether every rank set the
    same one (compared by a digest)."""

    key: str = ""
    same: bool = True


def failure_status(error: BaseException | str | None) -> list[str] | None:
    """What a rank tells the others of its ``error`` (``None``: it succeeded); see :func:`raise_failures`."""
    if error is None:
        return None
    message = error if isinstance(error, str) else error_text(error)
    kind = "CheckpointingError" if isinstance(error, str) else type(error).__name__
    return [kind, message[:_MAX_MESSAGE]]


def raise_failures(
    what: str, statuses: list[list[str] | None], error: BaseException | str | None = None
) -> None:
    """Raise the same error on every rank when any of the gathered :func:`failure_status` failed."""
    failures = {rank: s[1] for rank, s in enumerate(statuses) if s is not None}
    if not failures:
        return
    kinds = {s[0] for s in statuses if s is not None}
    message = failed_on_ranks(what, failures)
    # Every rank raises the same class: the failing ranks' common tierpoint error class, if any.
    err = agreed_error(kinds.pop() if len(kinds) == 1 else "", message, failures)
    if isinstance(error, BaseException):
        raise err from error
    raise err


@contextmanager
def agree(what: str) -> Iterator[Agreement]:
    """Run the block on every rank; if it raised on any rank, raise the same error on all of them.

    The block must not run collectives of its own (a failing rank would skip them). Every rank enters
    the agreement, so a rank whose block succeeded still learns that another one failed.
    """
    agreement = Agreement()
    error: BaseException | None = None
    try:
        yield agreement
    except Exception as e:  # noqa: BLE001 - every failure is reported to all ranks
        error = e
    digest = zlib.crc32(agreement.key.encode()) & 0x7FFFFFFF
    agreement.same = raise_if_any_failed(what, error, value=digest)
