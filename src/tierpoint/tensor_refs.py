"""Skeleton nodes that stand for tensors, shared: ``tensor_ref(i)`` is ``{"~": "tensor", "i": i}``.

Call order: :func:`tierpoint.tree.flatten` asks for the node of each tensor index it stores.

Invariants: there is one node per index (below :data:`SHARED`), made once and shared by every
skeleton, so a save of a state of thousands of tensors leaves no object per tensor for Python's
garbage collector (whose full collections of a training process's heap stop every thread, the one
launching kernels included). Shared, the nodes are read-only; they pickle and copy as plain dicts.
The list of nodes only grows, under a lock: node ``i`` always says ``i``.
"""

from __future__ import annotations

import threading
from typing import Any

SHARED = 1 << 16
"""Indices below this get a shared node; beyond it each call makes a fresh one."""


class _TensorRef(dict):
    """A read-only dict (see the module docstring)."""

    def _read_only(self, *_: Any, **__: Any) -> None:
        raise TypeError("a skeleton's tensor references are shared and read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _read_only  # type: ignore[assignment]
    __ior__ = _read_only  # type: ignore[assignment]

    def __reduce__(self) -> tuple[type, tuple[dict]]:
        return dict, (dict(self),)


_refs: list[_TensorRef] = []
_growing = threading.Lock()


def tensor_ref(index: int) -> dict[str, Any]:
    """The skeleton node of tensor ``index``."""
    if index >= SHARED:
        return {"~": "tensor", "i": index}
    if index >= len(_refs):
        with _growing:
            while len(_refs) <= index:
                _refs.append(_TensorRef({"~": "tensor", "i": len(_refs)}))
    return _refs[index]
