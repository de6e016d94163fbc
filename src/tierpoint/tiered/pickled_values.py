"""Values the persistent tier would store pickled that its restore could not load, named before
the save.

torch DCP stores every value of a state that is not a tensor and not a dict or list it walks
into (an int, a tuple, a dataclass) as ``torch.save`` bytes: a pickle. The persistent tier's
restore loads those with ``torch.load(weights_only=True)`` (:class:`tierpoint.dcp.SafeLoadPlanner`:
no code runs from a checkpoint), which refuses any class outside torch's short list. A state
holding such an object (a dataclass config, an enum, a ``frozenset``, a ``deque``) would save
without a word and make checkpoints that no restore loads, found out only when the job
restarts; :func:`unloadable_paths` names them so that the save is refused instead, as the
numpy values the tier cannot store are (:func:`tierpoint.tiered.numpy_values.unstorable_paths`).

Call order: :func:`unloadable_paths` on the persistent form of the state (after
:func:`tierpoint.tiered.numpy_values.as_tensors`), before the save is planned.

Invariants: a value is named where ``weights_only`` would refuse its pickle, read the way torch
DCP stores it: dicts (any mapping) and lists are walked into, their keys becoming names (never
pickled); anything else is a pickled leaf, which loads when it is a tensor, one of the builtin
values ``weights_only`` allows (containers checked item by item, dict keys too), or a class the
user allowed with ``torch.serialization.add_safe_globals`` whose pickled state and arguments (a
dataclass's fields, an enum's value) load too. numpy values are left to
:mod:`~tierpoint.tiered.numpy_values`. At most five paths are named.
"""

from __future__ import annotations

import collections
import copyreg
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..tree import child_path

NO_PICKLE_HINT = (
    "convert it to plain data (numbers, strings, lists, dicts, numpy values) or tensors, or keep "
    "it out of the state (the tiers store no pickles)"
)
"""What the error for a value the tiers cannot store tells to do (the manager takes no
``allow_pickle``)."""

_LOADABLE = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        bytearray,
        torch.Size,
        torch.dtype,
        torch.device,
    }
)
"""Values ``torch.load(weights_only=True)`` loads by default, beside tensors and containers."""

_CONTAINERS = (dict, collections.OrderedDict, collections.Counter, list, tuple, set)
"""Containers it loads (exactly these types: a subclass needs its class)."""

_SHOWN = 5


def unloadable_paths(tree: Any) -> list[str]:
    """``path (module.Type)`` of each value of ``tree`` (a persistent form) that torch DCP would
    pickle and ``weights_only`` refuse (at most five)."""
    found: list[str] = []
    allowed = _user_allowed()
    _walk(tree, "", False, allowed, found, set())
    return found


def _walk(
    value: Any, path: str, pickled: bool, allowed: set[type], found: list[str], seen: set[int]
) -> None:
    if len(found) >= _SHOWN or isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return
    if not pickled and isinstance(value, (Mapping, list)):  # torch DCP walks into these
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        for key, item in items:
            _walk(item, child_path(path, key), False, allowed, found, seen)
        return
    kind = type(value)
    if kind in _LOADABLE:
        return
    if kind in allowed:  # loads if what it pickles with it does (a Path in a config would not)
        if id(value) not in seen:
            seen.add(id(value))
            _walk(_pickled_with(value), path, True, allowed, found, seen)
        return
    if kind not in _CONTAINERS:
        found.append(f"{path or '(the state)'} ({kind.__module__}.{kind.__qualname__})")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            _walk(key, child_path(path, f"<key {key!r}>"), True, allowed, found, seen)
            _walk(item, child_path(path, key), True, allowed, found, seen)
    else:
        for i, item in enumerate(value):
            _walk(item, child_path(path, i), True, allowed, found, seen)


def _pickled_with(value: Any) -> dict[Any, Any]:
    """What pickling an instance of an allowed class stores beside its class (``torch.save``'s
    protocol 2), by name: its state (a dataclass's fields), its arguments (an enum's value)."""
    try:
        reduced = value.__reduce_ex__(2)
    except Exception:  # noqa: BLE001 - not picklable at all: the save itself says so
        return {}
    if not isinstance(reduced, tuple):
        return {}  # pickled by name
    fn, args, state, items, pairs = (*reduced, None, None, None)[:5]
    out = dict(state) if isinstance(state, dict) else {"<state>": state}
    out["<args>"] = args[1:] if fn is copyreg.__newobj__ else args  # (args[0]: the class)
    out["<items>"] = list(items or ())
    out["<pairs>"] = list(pairs or ())
    return out


def _user_allowed() -> set[type]:
    """The classes allowed with ``torch.serialization.add_safe_globals`` (or its context)."""
    out = set()
    for entry in torch.serialization.get_safe_globals():
        entry = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(entry, type):
            out.add(entry)
    return out
