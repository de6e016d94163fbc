"""numpy dtypes as JSON data for a state tree's skeleton, and back, checked as untrusted input.

Call order: :func:`dtype_spec` when a numpy value is flattened (:mod:`tierpoint.tree`);
:func:`numpy_dtype` when it is read back.

Invariants: a spec is a dtype's string (``"<f4"``, ``"<U5"``) or, for a structured dtype (whose
string, ``"|V12"``, names no fields), its fields; reading one never makes an object dtype, and
bounds the nesting, the number of fields and the subarray shapes (:class:`SkeletonError`
otherwise). Written by hand: numpy's own description (``dtype.descr``) does not give an aligned
structure back (its padding becomes unnamed fields), and ``np.lib.format`` parses Python literals.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .dtensors import SkeletonError


def dtype_spec(dtype: np.dtype) -> Any:
    """A numpy dtype as JSON: its string (``"<f4"``), or for a structured one (whose string,
    ``"|V12"``, names no fields) its fields: ``{"names", "formats", "offsets", "itemsize"}``, a
    field's format a spec too, or ``{"base": spec, "shape": [...]}`` for a field of subarrays."""
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        return {"base": dtype_spec(base), "shape": list(shape)}
    if dtype.names is None:
        return dtype.str
    fields = [dtype.fields[name] for name in dtype.names]
    return {
        "names": list(dtype.names),
        "formats": [dtype_spec(f[0]) for f in fields],
        "offsets": [f[1] for f in fields],
        "itemsize": dtype.itemsize,
    }


_MAX_FIELDS = 1024
_MAX_ITEMSIZE = 1 << 31


def numpy_dtype(spec: Any, depth: int = 0) -> np.dtype:
    """The dtype of a :func:`dtype_spec`, checked as untrusted input (no object dtypes)."""
    if depth > 8:
        raise SkeletonError("numpy dtype nested too deeply")
    if isinstance(spec, str):
        if len(spec) > 32:
            raise SkeletonError(f"bad numpy dtype {spec[:40]!r}")
        dtype = np.dtype(spec)
    elif isinstance(spec, dict) and "base" in spec:
        shape = spec["shape"]
        if not isinstance(shape, list) or not all(
            type(d) is int and 0 <= d < 1 << 20 for d in shape
        ):
            raise SkeletonError(f"bad numpy subarray shape {shape!r}")
        dtype = np.dtype((numpy_dtype(spec["base"], depth + 1), tuple(shape)))
    elif isinstance(spec, dict):
        names, formats, offsets = spec["names"], spec["formats"], spec["offsets"]
        lists = [names, formats, offsets]
        if not all(isinstance(v, list) and len(v) == len(names) <= _MAX_FIELDS for v in lists):
            raise SkeletonError("a structured numpy dtype needs names, formats and offsets alike")
        itemsize = spec["itemsize"]
        if (
            not all(isinstance(n, str) for n in names)
            or not all(type(o) is int and 0 <= o < _MAX_ITEMSIZE for o in offsets)
            or not (type(itemsize) is int and 0 <= itemsize < _MAX_ITEMSIZE)
        ):  # numpy takes C ints here: a larger one would raise OverflowError
            raise SkeletonError("bad structured numpy dtype (offsets or itemsize)")
        formats = [numpy_dtype(f, depth + 1) for f in formats]
        fields = {"names": names, "formats": formats, "offsets": offsets}
        dtype = np.dtype({**fields, "itemsize": itemsize})
    else:
        raise SkeletonError(f"bad numpy dtype {str(spec)[:40]!r}")
    if dtype.hasobject:
        raise SkeletonError("numpy object dtype is not allowed")
    return dtype
