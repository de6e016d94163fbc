"""The one restricted unpickler: runs the pickle machine on bytes from a checkpoint while letting
the file name nothing but the globals of an allow-list.

Two kinds of pickle in a torch DCP checkpoint are read with it, each with its own
:class:`AllowList`: the ``.metadata`` file (:mod:`tierpoint.dcp.metadata_globals`, loaded by
:func:`tierpoint.dcp.safe_pickle.safe_loads`) and the ``data.pkl`` of each saved tensor
(:mod:`tierpoint.dcp.saved_tensor`). An allow-list maps ``(module, name)`` to a stand-in: an inert
value or a small function that checks its arguments and returns inert values, never the real
class or function. A global outside the map, or a persistent id the allow-list has no handler
for, stops the load by raising the allow-list's own exception (``refuse(message)``) before
anything is called.

Call order: ``restricted_load(data, allow)`` -> ``(root, end)``: the unpickled object and where
its pickle ended in ``data`` (the caller refuses stray bytes after it). Exceptions other than the
refusal (a malformed stream, ``MemoryError``, a stand-in's own) pass through for the caller to
report as a format error. :func:`brief` formats hostile values for those messages.

Invariants: nothing named by a file is imported or called; an allow-list's ``globals`` mapping is
looked up at each load (not copied), so whoever owns it owns what is allowed.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

MAX_DIMS = 64
"""Most dimensions accepted in a tensor's size, offsets or strides."""
MAX_INT = (1 << 63) - 1
"""Largest offset, length or index accepted (a file offset must fit an ``off_t``)."""

DTYPES: dict[tuple[str, str], torch.dtype] = {
    ("torch", name): obj for name, obj in vars(torch).items() if isinstance(obj, torch.dtype)
}
"""The ``torch.<dtype>`` globals: the dtype objects themselves (immutable, not callable)."""


@dataclass(frozen=True)
class AllowList:
    """What one kind of pickle may name, and how a refusal is raised."""

    globals: Mapping[tuple[str, str], Any]
    """``(module, name)`` -> the stand-in the pickle gets instead."""
    refuse: Callable[[str], Exception]
    """Builds the exception raised for a forbidden global or persistent id, from its message."""
    where: str = ""
    """Appended to the message of a forbidden global (e.g. which pickle it was in)."""
    persistent: Callable[[Any], Any] | None = None
    """Resolves a persistent id (raising to refuse it); None: every persistent id is refused."""
    no_persistent: str = "forbidden persistent id"
    """The refusal's message when ``persistent`` is None."""


class _Unpickler(pickle.Unpickler):
    def __init__(self, stream: io.BytesIO, allow: AllowList) -> None:
        super().__init__(stream)
        self._allow = allow

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allow.globals[(module, name)]
        except (KeyError, TypeError):
            raise self._allow.refuse(
                f"forbidden global {module}.{name}{self._allow.where}"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._allow.persistent is None:
            raise self._allow.refuse(self._allow.no_persistent)
        return self._allow.persistent(pid)


def restricted_load(data: bytes, allow: AllowList) -> tuple[Any, int]:
    """The object pickled at the start of ``data``, built only from ``allow``'s stand-ins, and the
    offset in ``data`` where its pickle ended."""
    stream = io.BytesIO(data)
    root = _Unpickler(stream, allow).load()
    return root, stream.tell()


def brief(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters, computed without walking
    into nested containers or printing huge ints (a full repr of hostile data can hang, recurse too
    deep or raise)."""
    if type(value) in (list, tuple, torch.Size):
        inner = ", ".join(_brief_scalar(v, limit) for v in value[:16])
        inner += ", ..." if len(value) > 16 else ""
        text = {list: "[{}]", tuple: "({})", torch.Size: "torch.Size([{}])"}[type(value)]
        return text.format(inner)[:limit]
    return _brief_scalar(value, limit)[:limit]


def _brief_scalar(value: Any, limit: int) -> str:
    kind = type(value)
    if kind is int and value.bit_length() > 64:
        return f"<int of {value.bit_length()} bits>"
    if kind in (str, bytes):
        return repr(value[:limit])
    if value is None or kind in (bool, int, float, torch.dtype, torch.layout):
        return repr(value)
    return f"<{kind.__name__}>"
