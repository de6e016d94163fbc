"""The messages of a peer move: tags for headers, buckets and trailers, posted non-blocking and
waited for with a deadline.

Call order: :func:`~tierpoint.peers.transfer.move_files` takes the group's next call number
(:func:`next_call`), makes the call's :class:`Tags`, posts every send and receive (:func:`post`),
then waits for them (:func:`wait`).

Invariants:
- Tags never repeat within a process and group (a sequence per group that all ranks advance alike,
  one step per call), so a receive left over from a timed-out call can never match a later call's
  data. Calls on different groups may run at the same time on different threads.
- A gloo failure becomes a :class:`~tierpoint.errors.CheckpointingError` naming what was moved
  (a :class:`~tierpoint.errors.CoordinationTimeoutError` for a timeout).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointingError, CoordinationTimeoutError

DEFAULT_BUCKET_BYTES = 64 << 20
_TAGS_PER_CALL = 1 << 20
_calls: weakref.WeakKeyDictionary[Any, itertools.count] = weakref.WeakKeyDictionary()
"""group -> call sequence; weak, so a group replaced after a failed save is freed, not kept here."""
_default_calls = itertools.count()  # group None: the default group's sequence
_calls_lock = threading.Lock()


def next_call(group: Any) -> int:
    """This process's next call number on ``group`` (every rank of the group advances alike)."""
    with _calls_lock:
        if group is None:
            return next(_default_calls)
        return next(_calls.setdefault(group, itertools.count()))


class Tags:
    """Message tags of one call: below 2**31, disjoint from the previous 2047 calls' tags.

    A move's trailer uses the bucket tag after its last bucket."""

    def __init__(self, call: int, moves: int) -> None:
        self.base = (call % 2048) * _TAGS_PER_CALL
        self.moves = moves
        self.per_move = (_TAGS_PER_CALL - moves) // max(moves, 1)

    def header(self, move: int) -> int:
        return self.base + move

    def trailer(self, move: int, buckets: int) -> int:
        return self.bucket(move, buckets)

    def bucket(self, move: int, bucket: int) -> int:
        if bucket >= self.per_move:
            raise CheckpointingError(
                f"too many buckets for one file ({bucket + 1}); raise bucket_bytes"
            )
        return self.base + self.moves + move * self.per_move + bucket


def failure(e: BaseException, what: str) -> CheckpointingError:
    """What a gloo error while ``what`` means to the caller (a timeout, or a peer gone)."""
    text = str(e).strip().splitlines()[0][:300] if str(e).strip() else "no detail"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return CoordinationTimeoutError(f"{what}: timed out ({text})")
    return CheckpointingError(f"{what}: failed, the peer is probably gone ({text})")


def post(send: bool, tensor: torch.Tensor, peer: int, group: Any, tag: int, what: str) -> Any:
    """``isend`` / ``irecv``; a peer already gone may fail it at once, not only at the wait."""
    try:
        if send:
            return dist.isend(tensor, peer, group=group, tag=tag)
        return dist.irecv(tensor, peer, group=group, tag=tag)
    except (RuntimeError, dist.DistError) as e:
        raise failure(e, what) from e


def wait(work: Any, what: str, deadline: float) -> None:
    """Wait for one posted send or receive, at most until ``deadline``."""
    left = max(0.001, deadline - time.monotonic())
    try:
        ok = work.wait(timeout=timedelta(seconds=left))
    except (RuntimeError, dist.DistError) as e:
        raise failure(e, what) from e
    if ok is False:
        raise CoordinationTimeoutError(f"{what}: timed out")
