"""Lists that grew since the save (a trainer's log history), given the saved length on restore.

torch DCP stores a list item by item when it holds dicts, lists or tensors (``log.0.loss``,
``log.1.loss``), and as one value otherwise (an empty list too). A restore template is the live
state: a fresh job's log is ``[]``, so its names never match a checkpoint's ``log.<i>.*`` and the
persistent tier refused to restore what the local tier (which stores the structure itself) restores.
:func:`lists_as_saved` gives each such list the saved length, building the items the template lacks
from the names the checkpoint holds under them. Written by hand: torch DCP loads only into the
structure it is given.

Call order: on the persistent form of the restore template, before it is checked against the
checkpoint's metadata and loaded (:mod:`tierpoint.tiered.restoring`).

Invariants: only lists change (copies; the template is shared by the attempts at several steps),
and only lists whose template holds no tensor and no optimizer state, as in the local tier (a
list of tensors keeps its length and items). A template list, or item, whose torch DCP names
are those the checkpoint holds under its index (a tensor where it holds one) is kept (names
cannot tell a key ``"a.b"`` from ``a``, ``b``, nor show an empty dict or a key's type: the
template does); the others are made anew from the
checkpoint's names, in the saved order (the saved values replace the live ones in either tier): a
dict of the saved string keys, an empty tensor of the saved shape and dtype, or ``None`` for a
value (the load replaces it). A list under a name the checkpoint holds as one value becomes
``None`` (loaded whole). Lists whose items cannot be told from their names (a digit key: an int
dict key or an index) and optimizer state dicts (:mod:`~tierpoint.tiered.param_groups` compares
their groups) are left as they are, for the check against the checkpoint to name. The checkpoint's
names are indexed once per restore attempt (a long log costs one pass, not one per item).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import traverse_state_dict

from .param_groups import group_sizes

_CANNOT = object()


def lists_as_saved(tree: Any, stored: Mapping[str, Any]) -> Any:
    """``tree`` with its lists sized as the checkpoint (``stored``: its ``state_dict_metadata``)
    holds them; see the module docstring."""
    return _sized(tree, "", _Names(stored))


class _Names:
    """A checkpoint's names and, indexed on first use, those under each prefix."""

    def __init__(self, stored: Mapping[str, Any]) -> None:
        self.stored = stored
        self._parts: dict[str, dict[str, None]] | None = None  # the next parts, in saved order
        self._count: dict[str, int] = {}  # names at or under a prefix

    def __contains__(self, name: str) -> bool:
        return name in self.stored

    def __getitem__(self, name: str) -> Any:
        return self.stored[name]

    def _indexed(self) -> dict[str, dict[str, None]]:
        if self._parts is None:
            self._parts = {}
            for full in self.stored:
                parts = full.split(".")
                prefix = parts[0]
                for part in parts[1:]:
                    self._parts.setdefault(prefix, {})[part] = None
                    self._count[prefix] = self._count.get(prefix, 0) + 1
                    prefix = f"{prefix}.{part}"
                self._count[full] = self._count.get(full, 0) + 1
        return self._parts

    def children(self, name: str) -> list[str]:
        """The first name parts the checkpoint holds under ``name``, in the order saved."""
        return list(self._indexed().get(name, ()))

    def match(self, value: Any, name: str) -> bool:
        """Whether torch DCP names ``value`` at ``name`` exactly as the checkpoint's names there,
        each a tensor where the checkpoint holds one (a plain value where a tensor was saved is
        made anew: the saved list's items replace the live ones, as in the local tier)."""
        found = _dcp_leaves(value, name)
        self._indexed()
        return (
            len(found) == self._count.get(name, 0)
            and len({n for n, _ in found}) == len(found)
            and all(n in self.stored and _same_kind(v, self.stored[n]) for n, v in found)
        )


def _sized(value: Any, name: str, stored: _Names) -> Any:
    if isinstance(value, Mapping):
        if group_sizes(value) is not None:
            return value
        out = {k: _sized(v, _join(name, str(k)), stored) for k, v in value.items()}
        return value if all(out[k] is value[k] for k in out) else out
    if not isinstance(value, list) or not name:
        return value
    if _holds_layout(value):  # as the local tier: a list of tensors keeps its items and length
        items = [_sized(item, f"{name}.{i}", stored) for i, item in enumerate(value)]
        return value if all(map(_is, items, value)) else items
    if name in stored:  # saved as one value: loaded whole (into None where DCP would walk in)
        return value if _dcp_names(value, name) == [name] else None
    if stored.match(value, name):  # the template as saved (its empty dicts have no names)
        return value
    indices = stored.children(name)
    if not indices or set(indices) != {str(i) for i in range(len(indices))}:
        return value
    items = [
        value[i]
        if i < len(value) and stored.match(value[i], f"{name}.{i}")
        else _built(stored, f"{name}.{i}")
        for i in range(len(indices))
    ]
    if any(item is _CANNOT for item in items):
        return value
    return value if len(items) == len(value) and all(map(_is, items, value)) else items


def _built(stored: _Names, name: str) -> Any:
    """A placeholder for the saved value at ``name``, or ``_CANNOT``."""
    if name in stored:
        md = stored[name]
        size = getattr(md, "size", None)
        if size is None:
            return None
        return torch.empty(tuple(size), dtype=md.properties.dtype)
    keys = stored.children(name)
    if not keys or any(k.isdigit() for k in keys):
        return _CANNOT
    out = {}
    for key in keys:
        out[key] = _built(stored, f"{name}.{key}")
        if out[key] is _CANNOT:
            return _CANNOT
    return out


def _holds_layout(value: Any) -> bool:
    """Whether ``value`` holds a tensor or an optimizer's state dict (their layout is the model's:
    a restore must not change it)."""
    if isinstance(value, torch.Tensor) or group_sizes(value) is not None:
        return True
    if isinstance(value, Mapping):
        return any(_holds_layout(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_holds_layout(v) for v in value)


def _dcp_names(value: Any, name: str) -> list[str]:
    """The names torch DCP gives ``value`` and what it holds when stored at ``name``."""
    return [n for n, _ in _dcp_leaves(value, name)]


def _dcp_leaves(value: Any, name: str) -> list[tuple[str, Any]]:
    """:func:`_dcp_names` with the value torch DCP stores under each name."""
    found: list[tuple[str, Any]] = []
    traverse_state_dict({name: value}, lambda path, v: found.append((".".join(map(str, path)), v)))
    return found


def _same_kind(value: Any, md: Any) -> bool:
    """Whether ``value`` is a tensor exactly where the checkpoint's metadata ``md`` holds one."""
    return isinstance(value, torch.Tensor) == (getattr(md, "size", None) is not None)


def _is(a: Any, b: Any) -> bool:
    return a is b


def _join(name: str, key: str) -> str:
    return f"{name}.{key}" if name else key
