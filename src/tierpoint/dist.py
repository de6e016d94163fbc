"""Ranks, nodes, tierpoint's own coordination group, bounded collectives, and error agreement.

Call order: anything collective goes through :func:`coordination_group` (created lazily, once per
default process group, on every rank at the same call site), then :func:`reduce_ints` /
:func:`agree` (the common case: O(1) bytes per rank) or :func:`all_gather_json` /
:func:`broadcast_json` (details, plans). Each of them except the broadcast starts with one all-reduce
of a few integers that carries a hash of the step it serves, so ranks at different steps get one
clear error, and agreements gather texts only when some rank failed. With ``torch.distributed`` not initialised everything works
as a single process (rank 0 of 1) and no collective runs.

Invariants:
- tierpoint never issues collectives on the training group: the coordination group is a separate gloo
  group (also when the default group is NCCL), so background saves cannot deadlock training.
- Every collective is bounded by the group's timeout; a timeout or a vanished peer becomes a
  :class:`CheckpointingError` (:class:`CoordinationTimeoutError` for timeouts), never a hang.
- :func:`agree` makes every rank raise the same :class:`CheckpointingError`, naming each failing rank
  and its message, when any rank failed (a subclass such as :class:`CorruptCheckpointError` when all
  failing ranks raised that tierpoint class).
- Messages between ranks are JSON, never pickle.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
import socket
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import (
    CheckpointingError,
    CoordinationTimeoutError,
    agreed_error,
    error_text,
    failed_on_ranks,
)

DEFAULT_TIMEOUT_S = 300.0
"""Timeout of tierpoint's collectives; override with ``TIERPOINT_TIMEOUT`` (seconds)."""

_MAX_MESSAGE = 2000
_HEADER_VALUES = 8  # integers a step header carries (see _header)

_groups: dict[int, Any] = {}
_layouts: dict[int, NodeLayout] = {}
_node_groups: dict[int, NodeGroups] = {}
_broken: dict[int, tuple[Any, str]] = {}  # id(group) -> (the group, kept alive; what failed)

_logger = logging.getLogger("tierpoint")


def default_timeout() -> timedelta:
    text = os.environ.get("TIERPOINT_TIMEOUT")
    if text is None:
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise CheckpointingError(
            f"TIERPOINT_TIMEOUT must be a positive number of seconds, got {text!r}"
        )
    return timedelta(seconds=seconds)


def check_timeout(value: object) -> float:
    """``value`` as seconds, or ``TypeError`` / ``ValueError`` unless it is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"timeout must be a number of seconds (or None), got {type(value).__name__} {value!r}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {value}")
    return float(value)


def timeout_or(value: object, default: float) -> float:
    """``value`` checked by :func:`check_timeout`, or ``default`` when it is ``None``."""
    return default if value is None else check_timeout(value)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    if is_distributed():
        return dist.get_rank()
    refuse_uninitialised_launch()
    return 0


def get_world_size() -> int:
    if is_distributed():
        return dist.get_world_size()
    refuse_uninitialised_launch()
    return 1


def log_progress(what: str, nbytes: int, start: float) -> None:
    """One progress line for an operation that moved ``nbytes`` since ``time.perf_counter()`` was
    ``start``: INFO on rank 0, DEBUG on the others (one line per operation, not per rank)."""
    seconds = max(time.perf_counter() - start, 1e-9)
    level = logging.INFO if get_rank() == 0 else logging.DEBUG
    _logger.log(
        level,
        "%s: %.1f MiB in %.3f s, %.2f GB/s",
        what,
        nbytes / 2**20,
        seconds,
        nbytes / seconds / 1e9,
    )


def refuse_uninitialised_launch() -> None:
    """A launcher (torchrun, ...) started several processes but ``torch.distributed`` is not
    initialised: as "rank 0 of 1" every process would write the same files, so refuse."""
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        raise CheckpointingError(
            f"WORLD_SIZE={launched} is set but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group() before using tierpoint (or unset WORLD_SIZE "
            "for a single-process job)"
        )


def node_id() -> str:
    """This process's node identity.

    ``TIERPOINT_NODE_ID`` wins; otherwise the hostname, qualified by torchrun's ``GROUP_RANK`` when set
    (so that several simulated nodes on one machine count as different nodes).
    """
    explicit = os.environ.get("TIERPOINT_NODE_ID")
    if explicit:
        return explicit
    host = socket.gethostname()
    group_rank = os.environ.get("GROUP_RANK")
    return f"{host}/{group_rank}" if group_rank is not None else host


def coordination_group(timeout: timedelta | None = None) -> Any:
    """tierpoint's dedicated gloo group (``None`` when not distributed). Collective on first call."""
    if not is_distributed():
        return None
    key = id(dist.distributed_c10d._get_default_group())
    group = _groups.get(key)
    if group is None:
        group = _run_collective(
            "creating tierpoint's coordination group",
            dist.new_group,
            backend="gloo",
            timeout=timeout or default_timeout(),
        )
        _groups[key] = group
    return group


def _run_collective(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    group = kwargs.get("group")
    broken = _broken.get(id(group)) if group is not None else None
    if broken is not None:
        raise CheckpointingError(
            f"{what}: tierpoint's coordination group failed earlier ({broken[1]}) and a gloo group "
            "does not recover: restart the job (it resumes from the latest complete checkpoint)"
        )
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistError) as e:  # gloo reports timeouts and dead peers as these
        text = str(e)
        if group is not None:
            _broken[id(group)] = (group, f"{what}: {_first_line(text)}"[:300])
        if "timed out" in text.lower() or "timeout" in text.lower():
            silent = _silent_ranks(what, group)
            who = ""
            if silent:
                names = "rank " if len(silent) == 1 else "ranks "
                who = f"; no word from {names}{', '.join(map(str, silent))} (stopped or too slow)"
            raise CoordinationTimeoutError(
                f"{what}: ranks did not all arrive within the timeout{who} ({_first_line(text)})"
            ) from e
        raise CheckpointingError(
            f"{what}: collective failed, a peer rank is probably gone ({_first_line(text)})"
        ) from e


_SILENT_GRACE_S = 3.0


def _silent_ranks(what: str, group: Any) -> list[int]:
    """After a collective on ``group`` timed out: the ranks that did not report themselves alive
    through the job's store within a short grace (gloo's timeout does not say who is missing).
    Only on this failure path: one key per rank, read back rank by rank. ``[]`` when unknown."""
    try:
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(group) if group is not None else []
        if not ranks:
            ranks = list(range(dist.get_world_size()))
        step = zlib.crc32(f"{_step(what)}|{ranks}".encode()) & 0x7FFFFFFF
        prefix = f"tierpoint/alive/{step}/"
        store.set(prefix + str(dist.get_rank()), "1")
        missing = list(ranks)
        deadline = time.monotonic() + _SILENT_GRACE_S
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([prefix + str(r)])]
            if missing:
                time.sleep(0.1)
        return missing
    except Exception:  # noqa: BLE001 - naming the silent ranks is a courtesy; the timeout stands
        return []


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else "no detail"


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
    _run_collective(what, dist.all_gather, gathered, payload, group=group)
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
    _run_collective(what, dist.gather, payload, gathered, dst=dst, group=group)
    return [json.loads(bytes(g.numpy())) for g in gathered] if gathered is not None else None


def _padded_json(obj: Any, what: str, group: Any) -> tuple[torch.Tensor, int]:
    """``obj`` as JSON bytes padded with spaces to the longest any rank sends (the step header
    agrees on that length), and the length."""
    data = json.dumps(obj).encode()
    (longest,) = _header(what, group, [len(data)], "max")
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
    return _header(what, group or coordination_group(), values, op)


def _header(what: str, group: Any, values: list[int], op: str) -> list[int]:
    """One all-reduce (MAX) of ``[h, -h, *values]`` (values negated for ``op="min"``), ``h`` a hash
    of the kind of step ``what`` names: every rank learns whether all ranks are at the same step
    and the reduced ``values``. On a mismatch every rank gathers the steps and raises one error."""
    if op not in ("min", "max"):
        raise ValueError(f"op must be 'min' or 'max', got {op!r}")
    if len(values) > _HEADER_VALUES:
        raise ValueError(f"at most {_HEADER_VALUES} values per all-reduce, got {len(values)}")
    sign = -1 if op == "min" else 1
    h = zlib.crc32(_step(what).encode()) & 0x7FFFFFFF
    # Always the same length: ranks at different steps must meet in the same collective (gloo
    # aborts the process on a size mismatch) to learn that they are.
    t = torch.zeros(2 + _HEADER_VALUES, dtype=torch.int64)
    t[:2] = torch.tensor([h, -h])
    t[2 : 2 + len(values)] = torch.tensor([sign * int(v) for v in values], dtype=torch.int64)
    _run_collective(what, dist.all_reduce, t, op=dist.ReduceOp.MAX, group=group)
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


def _step(what: str) -> str:
    """The kind of step ``what`` names: numbers and paths may differ between ranks (node-local
    directories, iterations they disagree on: the callers check those with a better message)."""
    return re.sub(r"\d+", "N", re.sub(r"\S*[/\\]\S*", "<path>", what))


def _gather_bytes(data: bytes, what: str, group: Any, world: int) -> list[bytes]:
    """Every rank's ``data`` (sizes first: only on the rare paths that cannot use the header)."""
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    _run_collective(what, dist.all_gather, sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    _run_collective(what, dist.all_gather, gathered, padded, group=group)
    return [bytes(g[: int(s.item())].numpy()) for g, s in zip(gathered, sizes)]


def broadcast_json(obj: Any, src: int = 0, what: str = "broadcast", group: Any = None) -> Any:
    """``obj`` as given on global rank ``src``, on every rank."""
    if not is_distributed():
        return json.loads(json.dumps(obj))
    group = group or coordination_group()
    mine = dist.get_rank() == src
    payload = json.dumps(obj).encode() if mine else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    _run_collective(what, dist.broadcast, size, src=src, group=group)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if mine:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    _run_collective(what, dist.broadcast, buf, src=src, group=group)
    return json.loads(bytes(buf.numpy()))


def barrier(what: str = "barrier") -> None:
    reduce_ints([], "max", what)


@dataclass(frozen=True)
class NodeLayout:
    """Which node every rank lives on."""

    node_of_rank: tuple[str, ...]
    rank: int

    @property
    def nodes(self) -> list[str]:
        """Distinct node ids in order of their lowest rank."""
        return list(dict.fromkeys(self.node_of_rank))

    @property
    def node_index(self) -> int:
        return self.nodes.index(self.node_of_rank[self.rank])

    @property
    def local_ranks(self) -> list[int]:
        """Global ranks on this rank's node, ascending."""
        me = self.node_of_rank[self.rank]
        return [r for r, n in enumerate(self.node_of_rank) if n == me]

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def local_world_size(self) -> int:
        return len(self.local_ranks)


def node_layout() -> NodeLayout:
    """Every rank's node id (gathered once per process group, then cached). Collective on first call."""
    if not is_distributed():
        return NodeLayout((node_id(),), 0)
    key = id(dist.distributed_c10d._get_default_group())
    layout = _layouts.get(key)
    if layout is None:
        layout = NodeLayout(tuple(all_gather_json(node_id(), "gather node ids")), dist.get_rank())
        _layouts[key] = layout
    return layout


@dataclass(frozen=True)
class NodeGroups:
    """The groups a step coordinates through node by node: this rank's node (``node``), the nodes'
    leaders (``leaders``, ``None`` on other ranks) and the global rank of this node's leader (its
    lowest rank)."""

    node: Any
    leaders: Any
    leader: int


def node_groups() -> NodeGroups:
    """This rank's :class:`NodeGroups` (gloo; created once per process group, then cached).
    Collective on first call: every rank calls it, each joins only its node's group and, on a
    leader, the leaders' group (local synchronisation: no rank waits for groups it is not in)."""
    key = id(dist.distributed_c10d._get_default_group())
    groups = _node_groups.get(key)
    if groups is None:
        layout = node_layout()
        first: dict[str, int] = {}
        for r, node in enumerate(layout.node_of_rank):
            first.setdefault(node, r)
        leader = first[layout.node_of_rank[layout.rank]]

        def create(ranks: list[int], what: str) -> Any:
            return _run_collective(
                what,
                dist.new_group,
                ranks,
                backend="gloo",
                timeout=default_timeout(),
                use_local_synchronization=True,
            )

        node = create(layout.local_ranks, "creating tierpoint's node group")
        leaders = None
        if layout.rank == leader:
            leaders = create(sorted(first.values()), "creating tierpoint's node leaders' group")
        groups = _node_groups[key] = NodeGroups(node, leaders, leader)
    return groups


def gather_by_node(obj: Any, merge: Callable[[list[Any]], Any], what: str) -> list[Any]:
    """Every node's ``merge`` of its ranks' ``obj`` (JSON, in rank order), one per node in order
    of their lowest rank, on every rank. Collective, in three steps: each node's objects go to its
    leader, the leaders exchange their merges, each leader passes them on to its node. A leader
    receives its node's objects and every node's merge, any other rank every node's merge: O(nodes)
    bytes per rank when a merge is about as small as one rank's object."""
    if not is_distributed():
        return [merge([json.loads(json.dumps(obj))])]
    groups = node_groups()
    mine = gather_json(obj, groups.leader, what, groups.node)
    merged = None
    if groups.leaders is not None:
        assert mine is not None
        merged = all_gather_json(merge(mine), what, groups.leaders)
    return broadcast_json(merged, groups.leader, what, groups.node)


def raise_if_any_failed(what: str, error: BaseException | str | None, group: Any = None) -> None:
    """Collective: if any rank passes an error, every rank raises the same :class:`CheckpointingError`.

    One all-reduce of a flag when no rank failed; only then are the failures' texts gathered."""
    what_agreed = f"{what} (agreeing on the outcome)"
    (failed,) = reduce_ints([error is not None], "max", what_agreed, group)
    if failed:
        raise_failures(what, all_gather_json(failure_status(error), what_agreed, group), error)


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
def agree(what: str) -> Iterator[None]:
    """Run the block on every rank; if it raised on any rank, raise the same error on all of them.

    The block must not run collectives of its own (a failing rank would skip them). Every rank enters
    the agreement, so a rank whose block succeeded still learns that another one failed.
    """
    error: BaseException | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every failure is reported to all ranks
        error = e
    raise_if_any_failed(what, error)
