"""numpy values in the persistent tier: stored as tensors, given back as numpy.

torch DCP stores a numpy array or scalar pickled, and the persistent tier's restore loads no
pickles (numpy's unpickling can run code and crash the process), so a state holding
``np.random.get_state()`` or a numpy counter could not be restored from there. The persistent tier
therefore stores each numeric numpy value as a tensor of its dtype and shape (a plain DCP reader
sees that tensor), and restore turns it back into numpy of the live state's dtype and shape.

Call order: :func:`as_tensors` on the persistent form of the state before saving it, and on the
restore template before loading into it; :func:`as_numpy` with the loaded tree and that template
(its numpy values say where to convert back); :func:`unstorable_paths` names what stays numpy
(strings, objects, long double), which the persistent tier refuses.

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


def _is_numpy(value: Any) -> bool:
    return isinstance(value, (np.ndarray, np.generic))


def _tensor_of(value: np.ndarray | np.generic) -> torch.Tensor | None:
    arr = np.asarray(value)
    if not arr.dtype.isnative:  # a copy in this machine's byte order; restore swaps back
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return numpy_tensor(arr)


def _rebuilt(value: Any, items: list[Any]) -> Any:
    """``value`` (a list or tuple) with ``items``; ``value`` itself when no item changed."""
    if all(a is b for a, b in zip(items, value)):
        return value
    if isinstance(value, list):
        return items
    return type(value)._make(items) if hasattr(value, "_make") else tuple(items)


def as_tensors(tree: Any) -> Any:
    """``tree`` with each numpy value torch has a dtype for as a tensor (see the module docstring)."""
    if _is_numpy(tree):
        t = _tensor_of(tree)
        return tree if t is None else t
    if isinstance(tree, Mapping):
        out = {k: as_tensors(v) for k, v in tree.items()}
        return tree if all(out[k] is tree[k] for k in out) else out
    if isinstance(tree, (list, tuple)):
        return _rebuilt(tree, [as_tensors(v) for v in tree])
    return tree


def as_numpy(loaded: Any, template: Any) -> Any:
    """``loaded`` with each tensor that stands where ``template`` holds a numpy value turned back
    into numpy of that value's dtype and shape (a scalar for a scalar)."""
    if _is_numpy(template) and isinstance(loaded, torch.Tensor):
        arr = loaded.detach().cpu().numpy()
        arr = arr.astype(template.dtype, copy=False).reshape(np.shape(template))
        return arr[()] if isinstance(template, np.generic) else arr
    if isinstance(loaded, Mapping) and isinstance(template, Mapping):
        out = {k: as_numpy(v, template.get(k)) for k, v in loaded.items()}
        return loaded if all(out[k] is loaded[k] for k in out) else out
    if isinstance(loaded, (list, tuple)) and isinstance(template, (list, tuple)):
        if len(loaded) == len(template):
            return _rebuilt(loaded, [as_numpy(v, t) for v, t in zip(loaded, template)])
    return loaded


def unstorable_paths(tree: Any, path: str = "", found: list[str] | None = None) -> list[str]:
    """Where ``tree`` holds numpy values :func:`as_tensors` leaves as they are (at most five)."""
    found = [] if found is None else found
    if len(found) >= 5:
        return found
    if _is_numpy(tree):
        if _tensor_of(tree) is None:
            found.append(path or "(the state)")
    elif isinstance(tree, (Mapping, list, tuple)):
        items = tree.items() if isinstance(tree, Mapping) else enumerate(tree)
        for key, item in items:
            unstorable_paths(item, child_path(path, key), found)
    return found
