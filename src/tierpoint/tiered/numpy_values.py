"""numpy values in the persistent tier: stored as tensors and Python numbers, given back as numpy.

torch DCP stores a numpy array or scalar pickled, and the persistent tier's restore loads no
pickles (numpy's unpickling can run code and crash the process), so a state holding
``np.random.get_state()`` or a numpy counter could not be restored from there. The persistent tier
therefore stores each numeric numpy array as a tensor of its dtype and shape, and each numpy
number as the Python number of the same value (a counter that became ``np.int64`` restores into a
fresh state where it is still an ``int``, and the reverse); restore turns them back into numpy of
the live state's type. A tuple holding numpy values is stored as a list: torch DCP stores a tuple
as one pickled value, a list item by item, so that every tensor in it is checked against the
checkpoint (dtype, shape) with the rest of the state, on every rank, before anything is loaded.

Call order: :func:`as_tensors` on the persistent form of the state before saving it, and on the
restore template before loading into it; :func:`as_numpy` with the loaded tree and that template
(its numpy values and tuples say what to give back); :func:`unstorable_paths` names the numpy
values that stay as they are (strings, objects, long double, array subclasses such as masked
arrays or memory maps), which the persistent tier refuses.

Invariants: containers without numpy values are returned as they are (the same objects, so tensors
keep sharing memory with the live state); a converted array shares the array's memory when it is
contiguous, writable and of this machine's byte order, so a restore loads into it in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..tree import child_path, numpy_tensor

_NUMBERS = (bool, int, float, complex)


def _is_numpy(value: Any) -> bool:
    return isinstance(value, (np.ndarray, np.generic))


def _stored(value: np.ndarray | np.generic) -> torch.Tensor | bool | int | float | complex | None:
    """What the persistent tier stores for a numpy value; None where it cannot."""
    if isinstance(value, np.generic):
        kind, size = value.dtype.kind, value.dtype.itemsize
        exact = kind in "biu" or (kind == "f" and size <= 8) or (kind == "c" and size <= 16)
        return value.item() if exact else None  # long double: no Python number holds it
    if type(value) is not np.ndarray:  # a subclass (mask, memory map) would not come back whole
        return None
    arr = value if value.dtype.isnative else value.astype(value.dtype.newbyteorder("="))
    return numpy_tensor(arr)  # restore swaps the bytes back


def as_tensors(tree: Any) -> Any:
    """``tree`` with each numpy value it can store as a tensor or a Python number (see the module
    docstring); a tuple holding any becomes a list."""
    if _is_numpy(tree):
        stored = _stored(tree)
        return tree if stored is None else stored
    if isinstance(tree, Mapping):
        out = {k: as_tensors(v) for k, v in tree.items()}
        return tree if all(out[k] is tree[k] for k in out) else out
    if isinstance(tree, (list, tuple)):
        items = [as_tensors(v) for v in tree]
        return tree if all(a is b for a, b in zip(items, tree)) else items
    return tree


def as_numpy(loaded: Any, template: Any) -> Any:
    """``loaded`` with what stands where ``template`` holds a numpy value turned back into numpy of
    that value's type (a tensor into an array of its dtype and shape, a number into a numpy
    scalar), and lists where it holds a tuple back into tuples of its type."""
    if _is_numpy(template):
        if isinstance(loaded, torch.Tensor):
            arr = loaded.detach().cpu().numpy().astype(template.dtype, copy=False)
            arr = arr.reshape(np.shape(template))
            return arr[()] if isinstance(template, np.generic) else arr
        if isinstance(template, np.generic) and isinstance(loaded, _NUMBERS):
            return template.dtype.type(loaded)
        return loaded
    if isinstance(loaded, Mapping) and isinstance(template, Mapping):
        out = {k: as_numpy(v, template.get(k)) for k, v in loaded.items()}
        return loaded if all(out[k] is loaded[k] for k in out) else out
    if isinstance(loaded, (list, tuple)) and isinstance(template, (list, tuple)):
        if len(loaded) == len(template):
            items = [as_numpy(v, t) for v, t in zip(loaded, template)]
            if isinstance(template, tuple) and type(loaded) is not type(template):
                return type(template)._make(items) if hasattr(template, "_make") else tuple(items)
            return loaded if all(a is b for a, b in zip(items, loaded)) else type(loaded)(items)
    return loaded


def unstorable_paths(tree: Any, path: str = "", found: list[str] | None = None) -> list[str]:
    """Where ``tree`` holds numpy values :func:`as_tensors` leaves as they are (at most five)."""
    found = [] if found is None else found
    if len(found) >= 5:
        return found
    if _is_numpy(tree):
        if _stored(tree) is None:
            found.append(path or "(the state)")
    elif isinstance(tree, (Mapping, list, tuple)):
        items = tree.items() if isinstance(tree, Mapping) else enumerate(tree)
        for key, item in items:
            unstorable_paths(item, child_path(path, key), found)
    return found
