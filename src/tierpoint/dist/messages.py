"""JSON collectives with a step header: every rank learns that all ranks serve the same step.

Call order: :func:`reduce_ints` (the common case: O(1) bytes per rank) or :func:`all_gather_json` /
:func:`gather_json` (details, plans) / :func:`broadcast_json`, all on the coordination group unless
given another. Each of them except the broadcast starts with one all-reduce of a few integers that
carries a hash of the step it serves (:func:`header`), so ranks at different steps get one clear
error instead of a garbled message or a hang. With ``torch.distributed`` not initialised they
return this process's value (a JSON round trip) and no collective runs.

Invariants: messages between ranks are JSON, never pickle; the header is always the same length
(gloo aborts the process on a size mismatch); every collective is bounded (:mod:`.group`).
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointingError
from .group import coordination_group, run_collective, step_kind
from .ranks import is_distributed

_HEADER_VALUES = 8  # integers a step header carries (see header)


def all_gather_json(obj: Any, what: str = "all_gather", group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (JSON-serialisable), in rank order.

    ``what`` names the step; ranks at different steps (e.g. one saving, one loading) get the same
    clear error instead of a garbled message or a hang. Two collectives: the step header (which
    carries the longest payload's size) and one all-gather of the payloads, padded with spaces.
    Each rank receives O(W) bytes: for the common case use :func:`reduce_ints` or :func:`agree`.
    """
    if not is_distributed():
        return [json.loads(json.dumps(obj))]
    group = group or coordination_group()
    payload, longest = _padded_json(obj, what, group)
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(dist.get_world_size(group))]
    run_collective(what, dist.all_gather, gathered, payload, group=group)
    return [json.loads(bytes(g.numpy())) for g in gathered]


def gather_json(obj: Any, dst: int, what: str = "gather", group: Any = None) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on global rank ``dst``, ``None`` on the others: only
    ``dst`` receives O(W) bytes (the step header as in :func:`all_gather_json`)."""
    if not is_distributed():
        return [json.loads(json.dumps(obj))]
    group = group or coordination_group()
    payload, longest = _padded_json(obj, what, group)
    mine = dist.get_rank() == dst
    world = dist.get_world_size(group)
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)] if mine else None
    run_collective(what, dist.gather, payload, gathered, dst=dst, group=group)
    return [json.loads(bytes(g.numpy())) for g in gathered] if gathered is not None else None


def _padded_json(obj: Any, what: str, group: Any) -> tuple[torch.Tensor, int]:
    """``obj`` as JSON bytes padded with spaces to the longest any rank sends (the step header
    agrees on that length), and the length."""
    data = json.dumps(obj).encode()
    (longest,) = header(what, group, [len(data)], "max")
    payload = torch.full((longest,), ord(" "), dtype=torch.uint8)
    payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return payload, longest


def reduce_ints(values: list[int], op: str, what: str, group: Any = None) -> list[int]:
    """The smallest (``op="min"``) or largest (``"max"``) of each of a few integers over all ranks,
    in one all-reduce that also checks every rank is at the same step (see :func:`all_gather_json`).
    O(1) bytes per rank: the common case of every agreement (an iteration, "all done", "none
    failed")."""
    if not is_distributed():
        return [int(v) for v in values]
    return header(what, group or coordination_group(), values, op)


def header(what: str, group: Any, values: list[int], op: str) -> list[int]:
    """One all-reduce (MAX) of ``[h, -h, *values]`` (values negated for ``op="min"``), ``h`` a hash
    of the kind of step ``what`` names: every rank learns whether all ranks are at the same step
    and the reduced ``values``. On a mismatch every rank gathers the steps and raises one error."""
    if op not in ("min", "max"):
        raise ValueError(f"op must be 'min' or 'max', got {op!r}")
    if len(values) > _HEADER_VALUES:
        raise ValueError(f"at most {_HEADER_VALUES} values per all-reduce, got {len(values)}")
    sign = -1 if op == "min" else 1
    h = zlib.crc32(step_kind(what).encode()) & 0x7FFFFFFF
    # Always the same length: ranks at different steps must meet in the same collective (gloo
    # aborts the process on a size mismatch) to learn that they are.
    t = torch.zeros(2 + _HEADER_VALUES, dtype=torch.int64)
    t[:2] = torch.tensor([h, -h])
    t[2 : 2 + len(values)] = torch.tensor([sign * int(v) for v in values], dtype=torch.int64)
    run_collective(what, dist.all_reduce, t, op=dist.ReduceOp.MAX, group=group)
    reduced = t.tolist()[: 2 + len(values)]
    if reduced[0] != -reduced[1]:
        world = dist.get_world_size(group)
        steps = [g.decode() for g in _gather_bytes(what.encode(), what, group, world)]
        detail = "; ".join(f"rank {r}: {step[:200]!r}" for r, step in enumerate(steps))
        raise CheckpointingError(
            f"ranks are at different tierpoint steps ({detail}): every rank must make the same "
            "tierpoint calls in the same order"
        )
    return [sign * v for v in reduced[2:]]


def _gather_bytes(data: bytes, what: str, group: Any, world: int) -> list[bytes]:
    """Every rank's ``data`` (sizes first: only on the rare paths that cannot use the header)."""
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    run_collective(what, dist.all_gather, sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    run_collective(what, dist.all_gather, gathered, padded, group=group)
    return [bytes(g[: int(s.item())].numpy()) for g, s in zip(gathered, sizes)]


def broadcast_json(obj: Any, src: int = 0, what: str = "broadcast", group: Any = None) -> Any:
    """``obj`` as given on global rank ``src``, on every rank."""
    if not is_distributed():
        return json.loads(json.dumps(obj))
    group = group or coordination_group()
    mine = dist.get_rank() == src
    payload = json.dumps(obj).encode() if mine else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    run_collective(what, dist.broadcast, size, src=src, group=group)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if mine:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    run_collective(what, dist.broadcast, buf, src=src, group=group)
    return json.loads(bytes(buf.numpy()))


def barrier(what: str = "barrier") -> None:
    reduce_ints([], "max", what)
