"""The finalize rounds of :class:`~tierpoint.asyncsave.AsyncCallsQueue`: what the ranks agree on.

Call order (inside the queue's finalize, every rank at the same point): :func:`new_group` once,
in the first round that agrees (scheduling and ``no_dist`` rounds run no collective, so a queue
used by some ranks alone with ``no_dist=True`` needs no group); then per round
:func:`agree_progress` (how many leading calls finished everywhere, and how late the latest rank
is), and for each call finished everywhere :func:`agree_outcome` (every rank's outcome of it).

Invariants:
- Every round is O(1) bytes per rank when nothing failed: one all-reduce of two integers for the
  progress, one of a flag for an outcome; only when some rank failed a call are the outcomes
  gathered (2 KiB each, the message cut to 300 characters).
- Every rank gets the same answer in the same round, so the queue concludes the same calls
  everywhere (and its finalize functions may run collectives).
- A collective that fails raises :class:`RoundFailed` (with its cause): the ranks cannot agree any
  more, and the queue gives up. Nothing here knows about calls, workers or files.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from .. import dist as tpdist

NOT_LATE, WAIT_OVER, TIMED_OUT = 0, 1, 2
"""How late a blocking finalize round is on a rank (the ranks agree on the largest)."""

_STATUS_BYTES = 2048

Status = tuple[bool, str, str | None]
"""A rank's outcome of a call: ``(ok, message, error class name)``."""


class RoundFailed(Exception):
    """A collective of a round failed (a peer is gone, or it timed out); the message says what the
    ranks were agreeing on, the ``__cause__`` is the collective's error."""


def new_group() -> Any:
    """The queue's own gloo group (its rounds never interleave with the trainer's collectives).
    Collective over every rank; :class:`RoundFailed` when a rank does not join in time."""
    try:
        return dist.new_group(backend="gloo", timeout=tpdist.default_timeout())
    except RuntimeError as e:  # torch's DistStoreError: a rank did not join within the timeout
        raise RoundFailed(f"ranks could not create the queue's group ({e})") from e


def agree_progress(group: Any, ready: int, late: int) -> tuple[int, int]:
    """Calls finished on every rank (the fewest any rank finished), and the latest any rank is.
    Collective: one all-reduce of two integers."""
    both = _max_over_ranks(group, [-ready, late], "ranks could not agree on progress")
    return -both[0], both[1]


def agree_outcome(group: Any, mine: Status, description: str) -> dict[int, Status]:
    """The outcome of a call every rank finished: this rank's alone when no rank failed (one
    all-reduce of a flag), every rank's, by rank, when one did (then gathered). Collective."""
    why = f"{description}: ranks could not agree on the outcome"
    (failed,) = _max_over_ranks(group, [not mine[0]], why)
    if not failed:
        return {tpdist.get_rank(): mine}
    gathered = _all_gather(group, _encode(mine), why)
    return {rank: _decode(t) for rank, t in enumerate(gathered)}


def _max_over_ranks(group: Any, values: list[int], why: str) -> list[int]:
    """The largest of each of ``values`` over ``group``."""
    t = torch.tensor(values, dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as e:
        raise RoundFailed(f"{why} ({e})") from e
    return [int(v) for v in t.tolist()]


def _all_gather(group: Any, mine: torch.Tensor, why: str) -> list[torch.Tensor]:
    """Every rank's ``mine`` over ``group``."""
    world = dist.get_world_size(group)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    try:
        dist.all_gather(gathered, mine, group=group)
    except RuntimeError as e:
        raise RoundFailed(f"{why} ({e})") from e
    return gathered


def _encode(status: Status) -> torch.Tensor:
    ok, message, kind = status
    raw = json.dumps([ok, message[:300], kind]).encode()  # <= 6 bytes a char: fits
    out = torch.zeros(_STATUS_BYTES, dtype=torch.uint8)
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def _decode(t: torch.Tensor) -> Status:
    raw = bytes(t.numpy()).rstrip(b"\0")
    try:
        ok, message, kind = json.loads(raw)
    except ValueError:
        return False, "unreadable status from a peer", None
    return bool(ok), str(message), kind
