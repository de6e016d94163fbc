"""Values the persistent tier stores once for every rank must be alike on every rank: a check that
names the ones that are not.

torch DCP (and so the persistent tier) takes a tensor or plain value that is not a DTensor and not
:class:`~tierpoint.RankLocal` to be replicated: one rank's copy is written, and every rank restores
it. A value that in fact differs between ranks (a data position, an RNG state) would come back the
same on every rank, each key from whichever rank wrote it, without a word. So before each
persistent save, each rank hashes every top-level value's plain data and small integer CPU tensors
(and, apart, the layout: keys, types, dtypes and shapes), and one all-reduce tells whether the ranks
agree; only when the layouts agree and the data does not are the per-key hashes gathered, and rank
0 logs a WARNING naming the keys (once per key and manager). Ranks whose layouts differ (pipeline
stages, each with its own keys) are not compared.

The same all-reduce refuses, on every rank, a state holding numpy values that are not numbers
(numeric ones are stored as tensors and numbers: :mod:`~tierpoint.tiered.numpy_values`) or other
objects the restore's ``weights_only`` unpickler refuses (a dataclass, an enum:
:mod:`~tierpoint.tiered.pickled_values`): torch DCP would store them pickled, and a checkpoint no
restore can load is worse than none.

Call order: :meth:`ReplicaCheck.check` on every rank with the persistent form of the state, before
the save is planned (collective).

Invariants: one small all-reduce per save when the ranks agree; floating-point, large or device
tensors are described by dtype and shape only (batch-norm statistics drift apart between
data-parallel ranks by design; hashing the model would cost a pass over it, and a device copy, per
save): the check finds the small per-rank values that are the usual mistake (positions, counters,
RNG states). Nothing here raises before the collective (a tensor whose bytes cannot be read counts
by its layout). DTensors and the rank-local key are left out: they are stored per rank already.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import xxhash

from .. import dist as tpdist
from ..dtensors import is_dtensor
from ..errors import CheckpointingError
from .numpy_values import unstorable_paths
from .pickled_values import unloadable_paths
from .state import RANK_LOCAL_KEY

logger = logging.getLogger("tierpoint")

HASHED_TENSOR_BYTES = 64 * 1024
"""Integer CPU tensors up to this size are hashed by value; others by dtype and shape."""

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_MASK = 2**62 - 1  # a hash that reduce_ints carries as a signed 64-bit value, negated too


def _feed(layout: Any, data: Any, value: Any, depth: int = 0) -> None:
    """Hash ``value``'s structure (keys, types, tensor dtypes and shapes) into ``layout`` and its
    data (plain values, small CPU tensors' bytes) into ``data``."""
    if depth > 100:
        layout.update(b"deep")
    elif isinstance(value, Mapping):
        layout.update(b"{")
        for name, _, item in _in_key_order(value):
            layout.update(name)
            _feed(layout, data, item, depth + 1)
        layout.update(b"}")
    elif isinstance(value, (list, tuple)):
        layout.update(b"[")
        for item in value:
            _feed(layout, data, item, depth + 1)
        layout.update(b"]")
    elif isinstance(value, torch.Tensor):
        if is_dtensor(value):
            return
        layout.update(f"{value.dtype}{tuple(value.shape)}".encode())
        if _compared(value):
            try:
                data.update(
                    value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                )
            except (RuntimeError, TypeError, ValueError):  # a tensor whose bytes torch won't show
                data.update(b"?")
    elif isinstance(value, _PLAIN):
        layout.update(type(value).__name__.encode())
        data.update(repr(value).encode())
    else:  # an object torch DCP pickles: its repr may hold an address, so its type stands for it
        layout.update(type(value).__qualname__.encode())


def _compared(tensor: torch.Tensor) -> bool:
    """Whether a tensor's bytes are compared: small, dense, on the CPU and not floating point (an
    RNG state, a counter, a position; floating-point buffers such as batch-norm statistics
    legitimately drift apart between data-parallel ranks, and torch DCP keeps one copy of them)."""
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_nested
        and not (tensor.dtype.is_floating_point or tensor.dtype.is_complex)
        and tensor.numel() * tensor.element_size() <= HASHED_TENSOR_BYTES
    )


def digests(tree: Mapping[str, Any]) -> tuple[int, dict[str, int]]:
    """A hash of the layout of the values stored once for every rank, and of each top-level
    value's data."""
    layout, out = xxhash.xxh3_64(), {}
    for name, key, value in _in_key_order(tree):
        if key == RANK_LOCAL_KEY:
            continue
        data = xxhash.xxh3_64()
        layout.update(name)
        _feed(layout, data, value)
        out[str(key)] = data.intdigest() & _MASK
    return layout.intdigest() & _MASK, out


def _in_key_order(mapping: Mapping[Any, Any]) -> list[tuple[bytes, Any, Any]]:
    """``mapping``'s items (with each key's ``repr``) in the order of those: ranks that built a
    dict in another order (from a set, say) hold the same state."""
    return sorted(((repr(k).encode(), k, v) for k, v in mapping.items()), key=lambda i: i[0])


class ReplicaCheck:
    """The check of one manager (it remembers which keys it has warned about)."""

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def check(self, tree: Mapping[str, Any], step: int) -> list[str]:
        """Collective: the keys of ``tree`` whose values differ between ranks (the same list on
        every rank); rank 0 warns about the ones not named before. Raises
        :class:`CheckpointingError` on every rank when any rank's ``tree`` holds numpy values that
        are not numbers (:func:`~tierpoint.tiered.numpy_values.unstorable_paths`) or objects the
        restore cannot unpickle (:func:`~tierpoint.tiered.pickled_values.unloadable_paths`): torch
        DCP would pickle them, making a checkpoint no restore loads; in the same all-reduce."""
        refused = unstorable_paths(tree), unloadable_paths(tree)
        if not tpdist.is_distributed() or tpdist.get_world_size() < 2:
            if any(refused):
                raise CheckpointingError(_refusal(*refused))
            return []
        layout, mine = digests(tree)
        data = xxhash.xxh3_64(repr(sorted(mine.items())).encode()).intdigest() & _MASK
        what = f"comparing the replicated values of step {step}"
        count = len(refused[0]) + len(refused[1])
        low = tpdist.reduce_ints([layout, -layout, data, -data, -count], "min", what)
        if low[4] < 0:
            raise CheckpointingError(_refusal(*refused))
        if low[0] != -low[1] or low[2] == -low[3]:
            return []  # other keys per rank (pipeline stages: nothing to compare), or all alike
        every = tpdist.all_gather_json(mine, what)
        differ = sorted({k for d in every for k in d if any(e[k] != d[k] for e in every)})
        new = [k for k in differ if k not in self.warned]
        self.warned.update(new)
        if new and tpdist.get_rank() == 0:
            logger.warning(
                "step %d: %s differ between ranks, but the persistent tier keeps one copy for "
                "every rank (torch DCP takes such values to be replicated): each rank would restore "
                "the same value. Wrap values that differ per rank in RankLocal",
                step,
                ", ".join(repr(k) for k in new),
            )
        return differ


def _refusal(numpy_paths: list[str], object_paths: list[str]) -> str:
    if not numpy_paths and not object_paths:
        return (
            "another rank's state holds values that torch DCP stores pickled and tierpoint's "
            "restore, loading no pickles, would refuse (named in that rank's error)"
        )
    what = []
    if numpy_paths:
        what.append(
            f"numpy values that are not numbers ({', '.join(numpy_paths)}): hold them as lists "
            "or strings (the local tier stores them as they are)"
        )
    if object_paths:
        what.append(
            f"objects the restore cannot unpickle ({', '.join(object_paths)}): hold plain data "
            "(dicts, lists, tuples, numbers, strings, tensors), give their holder state_dict() "
            "and load_state_dict(), or allow the class with torch.serialization.add_safe_globals"
        )
    return (
        "torch DCP would store these pickled, and tierpoint's restore, loading no pickles, "
        "would refuse them: " + "; ".join(what)
    )
