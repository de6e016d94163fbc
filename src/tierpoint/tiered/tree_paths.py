"""A value at a torch DCP name in a state tree, replaced without changing the tree.

torch DCP names a value by its keys joined with dots, each key as its ``str`` (an int key ``8``
is ``"8"``, a list index too), and ``flatten_state_dict`` gives those strings as the path: setting
a value by them would add a key ``"8"`` beside the int key ``8``. :func:`replaced` finds the key
each part names (:func:`tierpoint.dcp.loading.key_named`, as a persistent load does).

Call order: ``tree = replaced(tree, parts, value)``; :func:`holds` asks whether a checkpoint's
names hold a value at a name or under it.
Invariants: the containers along the path are copies (a restore's template is shared by the
attempts at several steps); every other container and value is the same object.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ..dcp.loading import key_named


def replaced(tree: Any, parts: Sequence[Any], value: Any) -> Any:
    """``tree`` with ``value`` where ``parts`` (keys, or their ``str``) lead."""
    if not parts:
        return value
    part, rest = parts[0], parts[1:]
    if isinstance(tree, Mapping):
        key = key_named(tree, part)
        return {**tree, key: replaced(tree[key], rest, value)}
    items = list(tree)
    items[int(part)] = replaced(items[int(part)], rest, value)
    return items if isinstance(tree, list) else tuple(items)


def holds(names: Collection[str], name: str) -> bool:
    """Whether ``names`` (a checkpoint's) hold ``name`` or a value under it (``name.``...)."""
    return name in names or any(n.startswith(name + ".") for n in names)
