"""numpy values in the persistent tier: stored as tensors and Python numbers, given back as numpy.

torch DCP stores a numpy array or scalar pickled (loaded by tierpoint's default DCP load only
through ``weights_only``'s allow-list, numpy's array, scalar and dtype rebuilders added), and a
pickled value is read whole on one rank and copied, never resharded or read in place. The
persistent tier therefore stores each numeric numpy array as a tensor of its dtype and shape, and each numpy
number as the Python number of the same value (a counter that became ``np.int64`` restores into a
fresh state where it is still an ``int``, and the reverse); restore turns them back into numpy of
the live state's type. A tuple holding numpy values is stored as a list: torch DCP stores a tuple
as one pickled value, a list item by item, so that its tensors are read like any other.

A restore replaces numpy values, as the local tier does, rather than copying into them: an array
whose shape or dtype changed since the save (a data loader's index over a grown dataset, a buffer
that became float32) takes the saved one, as it would from plain torch DCP (which pickles them).

Call order: :func:`as_tensors` on the persistent form of the state before saving it, and on the
restore template before loading into it (``made`` collects the tensors it made from arrays);
:func:`sized_as_saved` gives those the checkpoint's shape and dtype (in a copy of the tree); :func:`as_numpy` with the
loaded tree and the live template (its numpy values and tuples say what to give back);
:func:`unstorable_paths` names the numpy values that stay as they are (strings, objects, long
double, array subclasses such as masked arrays or memory maps), which the persistent tier refuses.

Invariants: containers without numpy values are returned as they are (the same objects, so tensors
keep sharing memory with the live state); a converted array shares the array's memory when it is
contiguous, writable and of this machine's byte order, so a restore of the same shape and dtype
loads into it in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..tree import child_path, numpy_tensor
from .tree_paths import replaced

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


def as_tensors(tree: Any, made: list[torch.Tensor] | None = None) -> Any:
    """``tree`` with each numpy value it can store as a tensor or a Python number (see the module
    docstring); a tuple holding any becomes a list. The tensors made from arrays are appended to
    ``made`` when given."""
    if _is_numpy(tree):
        stored = _stored(tree)
        if isinstance(stored, torch.Tensor) and made is not None:
            made.append(stored)
        return tree if stored is None else stored
    if isinstance(tree, Mapping):
        out = {k: as_tensors(v, made) for k, v in tree.items()}
        return tree if all(out[k] is tree[k] for k in out) else out
    if isinstance(tree, (list, tuple)):
        items = [as_tensors(v, made) for v in tree]
        return tree if all(a is b for a, b in zip(items, tree)) else items
    return tree


def sized_as_saved(tree: dict[str, Any], made: list[torch.Tensor], metadata: Any) -> dict[str, Any]:
    """``tree`` (a restore template from :func:`as_tensors`) with each tensor of ``made`` whose
    shape or dtype differs from the checkpoint's at its place replaced by an empty one of the
    checkpoint's, so that the saved array loads whole. Left as they are: places the checkpoint
    lacks or holds as a plain value, and dtypes numpy has no type for (bfloat16), which the check
    against the checkpoint then names."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    ids = {id(t) for t in made}
    flat, places = flatten_state_dict(tree)
    for name, value in flat.items():
        stored = metadata.state_dict_metadata.get(name)
        size = getattr(stored, "size", None)
        if id(value) not in ids or size is None:
            continue
        dtype = stored.properties.dtype
        if tuple(size) == tuple(value.shape) and dtype == value.dtype:
            continue
        try:
            torch.empty(0, dtype=dtype).numpy()
        except TypeError:
            continue
        tree = replaced(tree, places[name], torch.empty(tuple(size), dtype=dtype))
    return tree


def as_numpy(loaded: Any, template: Any) -> Any:
    """``loaded`` with what stands where ``template`` holds a numpy value turned back into numpy (a
    tensor into an array, in the template's byte order where the dtypes agree; a number into a
    numpy scalar of the template's type), and lists where it holds a tuple back into tuples of its
    type."""
    if _is_numpy(template):
        if isinstance(loaded, torch.Tensor):
            arr = loaded.detach().cpu().numpy()
            if arr.dtype == template.dtype.newbyteorder("="):  # back to the live byte order
                arr = arr.astype(template.dtype, copy=False)
            return arr[()] if isinstance(template, np.generic) and arr.ndim == 0 else arr
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
