"""Flatten nested training state into a JSON skeleton plus a list of tensors, and back.

Call order: ``flatten(state)`` gives a :class:`FlatState` (``skeleton``, ``tensors``, ``paths``); the
skeleton is plain JSON data, so it can be stored in a file header without pickle. ``unflatten(skeleton,
tensors)`` rebuilds an equal state. The same tensor object reached twice (tied weights) is stored once and
comes back as one object in both places.

Invariants:
- Only the types listed below are stored; any other object raises :class:`UnsupportedStateError`
  naming its key path, unless ``allow_pickle=True`` is passed on both save and load.
- ``unflatten`` treats the skeleton as untrusted input: unknown tags, bad indices and runaway nesting
  raise :class:`CorruptCheckpointError` (via :class:`SkeletonError`), never anything worse.
- This module imports :mod:`tierpoint.dtensors` (below it: the DTensor nodes' encoding, and
  :class:`SkeletonError`, which both raise and this module re-exports); never the other way round.

Skeleton encoding. JSON scalars stand for themselves except where JSON is lossy; everything else is a
JSON object with a single tag key ``"~"``:

=============================  =================================================
``None``/``bool``/``str``      ``null``/``true``/``false``/``"..."``
``int`` (|x| < 2**53)          JSON integer; larger: ``{"~": "int", "v": "<decimal>"}``
``float``                      JSON number; nan/inf: ``{"~": "float", "v": "nan"}``
``list``                       JSON array
``tuple``                      ``{"~": "tuple", "v": [...]}``
``dict`` / ``OrderedDict``     ``{"~": "dict" | "odict", "k": [keys...], "v": [values...]}``
``bytes``                      ``{"~": "bytes", "v": "<base64>"}``
tensor                         ``{"~": "tensor", "i": <index into tensors>}``
DTensor                        ``{"~": "dtensor", "i": <index of its local shard>, "d": {...}}``
                               (:mod:`tierpoint.dtensors`: mesh, placements, global shape)
``torch.dtype/Size/device``    ``{"~": "dtype" | "size" | "device", "v": ...}``
numpy array (numeric)          ``{"~": "ndarray", "i": <index>}`` (stored as a tensor)
numpy array (other, no object) ``{"~": "ndbytes", "dtype": "<U5", "shape": [...], "v": "<base64>"}``
numpy scalar                   ``{"~": "npscalar", "dtype": "<f4", "v": "<base64>"}``
                               (a structured dtype: its fields, see :mod:`tierpoint.numpy_dtypes`)
anything else, opted in        ``{"~": "pickle", "v": "<base64>"}``
=============================  =================================================
"""

from __future__ import annotations

import base64
import math
import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import dtensors
from .dtensors import SkeletonError
from .errors import UnsupportedStateError, check_flag
from .numpy_dtypes import dtype_spec, numpy_dtype
from .tensor_refs import tensor_ref

MAX_DEPTH = 200
"""Deepest nesting accepted on flatten and unflatten (JSON bombs in a header stop here)."""

_JSON_SAFE_INT = 2**53
_TAG = "~"
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
"""Tensor types that are never DTensors (exactly these types: a subclass may be one)."""


@dataclass
class FlatState:
    """A flattened state: ``skeleton`` (JSON data), ``tensors`` and each tensor's key path."""

    skeleton: Any
    tensors: list[torch.Tensor] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    numpy_indices: set[int] = field(default_factory=set)
    """Indices of tensors that were numpy arrays in the original state."""


def child_path(path: str, key: object) -> str:
    if isinstance(key, str):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


PICKLE_HINT = "convert it to plain data, or pass allow_pickle=True on save and load"


def flatten(state: Any, *, allow_pickle: bool = False, hint: str = PICKLE_HINT) -> FlatState:
    """Split ``state`` into a JSON skeleton and its tensors (in first-seen order); ``hint``: what
    the error for an unsupported object tells to do (a caller without ``allow_pickle`` says so)."""
    check_flag("allow_pickle", allow_pickle)
    flat = FlatState(skeleton=None)
    seen: dict[int, int] = {}

    def add_tensor(t: torch.Tensor, path: str) -> int:
        index = seen.get(id(t))
        if index is None:
            index = len(flat.tensors)
            seen[id(t)] = index
            flat.tensors.append(t)
            flat.paths.append(path)
        return index

    def enc(obj: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedStateError(path, f"nesting deeper than {MAX_DEPTH} levels")
        if obj is None or type(obj) in (bool, str):
            return obj
        if type(obj) in (dict, OrderedDict):  # the common nodes first: a save walks them all
            # str and int keys and plain values stand for themselves: no key path is made for them
            keys = [
                k
                if type(k) is str or (type(k) is int and -_JSON_SAFE_INT < k < _JSON_SAFE_INT)
                else enc(k, child_path(path, f"<key {k!r}>"), depth + 1)
                for k in obj
            ]
            values = [
                v if v is None or type(v) in (bool, str) else enc(v, child_path(path, k), depth + 1)
                for k, v in obj.items()
            ]
            return {_TAG: "odict" if type(obj) is OrderedDict else "dict", "k": keys, "v": values}
        if type(obj) in PLAIN_TENSOR_TYPES and obj.layout == torch.strided and not obj.is_nested:
            return tensor_ref(add_tensor(obj, path))  # not a DTensor: no check for one
        if dtensors.is_dtensor(obj):
            desc = dtensors.describe(obj, path)
            return {_TAG: "dtensor", "i": add_tensor(dtensors.local_shard(obj), path), "d": desc}
        if isinstance(obj, torch.Tensor):
            if obj.is_nested:
                raise UnsupportedStateError(path, "nested tensors are not supported")
            if obj.is_sparse or obj.layout != torch.strided:
                raise UnsupportedStateError(path, f"tensor layout {obj.layout} is not supported")
            return tensor_ref(add_tensor(obj, path))
        if type(obj) is int:
            return obj if -_JSON_SAFE_INT < obj < _JSON_SAFE_INT else {_TAG: "int", "v": str(obj)}
        if type(obj) is float:
            return obj if math.isfinite(obj) else {_TAG: "float", "v": repr(obj)}
        if type(obj) is list:
            return [enc(v, child_path(path, i), depth + 1) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return {
                _TAG: "tuple",
                "v": [enc(v, child_path(path, i), depth + 1) for i, v in enumerate(obj)],
            }
        if type(obj) is bytes:
            return {_TAG: "bytes", "v": base64.b64encode(obj).decode("ascii")}
        if isinstance(obj, torch.dtype):
            return {_TAG: "dtype", "v": str(obj).removeprefix("torch.")}
        if type(obj) is torch.Size:
            return {_TAG: "size", "v": list(obj)}
        if isinstance(obj, torch.device):
            return {_TAG: "device", "v": str(obj)}
        if isinstance(obj, np.ndarray) and not (allow_pickle and obj.dtype.hasobject):
            return _enc_ndarray(obj, path, add_tensor, flat)
        if isinstance(obj, np.generic) and obj.dtype.kind != "O":
            return {_TAG: "npscalar", "dtype": dtype_spec(obj.dtype), "v": _b64(obj.tobytes())}
        if allow_pickle:
            try:
                return {_TAG: "pickle", "v": _b64(pickle.dumps(obj, protocol=4))}
            except Exception as e:  # noqa: BLE001 - any pickling failure is the user's object
                raise UnsupportedStateError(path, f"cannot pickle {type(obj).__name__}: {e}") from e
        raise UnsupportedStateError(
            path,
            f"objects of type {type(obj).__module__}.{type(obj).__qualname__} cannot be stored "
            f"without pickle; {hint}",
        )

    try:
        flat.skeleton = enc(state, "", 0)
    finally:
        enc = None  # (a recursive closure is a reference cycle: it would keep ``flat`` until a GC)
    return flat


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _enc_ndarray(arr: np.ndarray, path: str, add_tensor: Any, flat: FlatState) -> Any:
    if arr.dtype.kind == "O" or arr.dtype.hasobject:
        raise UnsupportedStateError(
            path, "numpy arrays of Python objects cannot be stored without pickle"
        )
    t = numpy_tensor(arr)
    if t is None or arr.dtype.byteorder == ">":
        return {
            _TAG: "ndbytes",
            "dtype": dtype_spec(arr.dtype),
            "shape": list(arr.shape),
            "v": _b64(np.ascontiguousarray(arr).tobytes()),
        }
    index = add_tensor(t, path)
    flat.numpy_indices.add(index)
    return {_TAG: "ndarray", "i": index}


def numpy_tensor(arr: np.ndarray) -> torch.Tensor | None:
    """A CPU tensor of ``arr``'s values, dtype and shape, sharing its memory when it is contiguous;
    None where torch has no such dtype (strings, long double) or the byte order is not native."""
    if arr.dtype.hasobject:
        return None
    # reshape: ascontiguousarray turns a 0-d array into a 1-d one
    contiguous = np.ascontiguousarray(arr).reshape(arr.shape)
    if not contiguous.flags.writeable:  # torch would warn: its tensors are writable
        contiguous = contiguous.copy()
    try:
        return torch.from_numpy(contiguous)
    except (TypeError, ValueError):  # ValueError: non-native byte order
        return None


def unflatten(
    skeleton: Any,
    tensors: list[torch.Tensor],
    *,
    allow_pickle: bool = False,
    build_dtensors: bool = True,
) -> Any:
    """Rebuild the state that :func:`flatten` split. Raises :class:`SkeletonError` on bad input.

    ``build_dtensors=False``: a DTensor's description is only checked for form and its local shard
    is returned (no device mesh is looked up or made: for checks on any rank, at any time)."""
    check_flag("allow_pickle", allow_pickle)

    def tensor_at(node: dict) -> torch.Tensor:
        i = node.get("i")
        if type(i) is not int or not 0 <= i < len(tensors):
            raise SkeletonError(f"tensor index {i!r} out of range (0..{len(tensors) - 1})")
        return tensors[i]

    def dec(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise SkeletonError(f"skeleton nested deeper than {MAX_DEPTH} levels")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [dec(v, depth + 1) for v in node]
        if not isinstance(node, dict):
            raise SkeletonError(f"unexpected skeleton node of type {type(node).__name__}")
        tag = node.get(_TAG)
        try:
            if tag == "dtensor":
                local = tensor_at(node)
                if not build_dtensors:
                    dtensors.check_description(local, node["d"])
                    return local
                return dtensors.rebuild(local, node["d"])
            return _DECODERS[tag](node, dec, depth, tensor_at, allow_pickle)
        except KeyError as e:
            if tag not in _DECODERS:
                raise SkeletonError(f"unknown skeleton tag {tag!r}") from None
            raise SkeletonError(f"skeleton node {tag!r} lacks field {e}") from None
        except (TypeError, ValueError, OverflowError) as e:
            if isinstance(e, SkeletonError):
                raise
            raise SkeletonError(f"malformed {tag!r} node: {e}") from None

    try:
        return dec(skeleton, 0)
    except RecursionError:
        raise SkeletonError("skeleton nested too deeply") from None
    finally:
        # A recursive closure is a reference cycle: it would keep ``tensors`` (a mapped file's,
        # which is not rewritten while they live) alive until a garbage collection.
        dec = None


def _dec_dict(node: dict, dec: Any, depth: int, *_: Any) -> dict:
    keys, values = node["k"], node["v"]
    if not isinstance(keys, list) or not isinstance(values, list) or len(keys) != len(values):
        raise SkeletonError("dict node needs equal-length key and value lists")
    cls = OrderedDict if node[_TAG] == "odict" else dict
    out = cls()
    for k, v in zip(keys, values):
        key = dec(k, depth + 1)
        try:
            out[key] = dec(v, depth + 1)
        except TypeError:
            raise SkeletonError(f"unhashable dict key {key!r}") from None
    return out


def _dec_float(node: dict, *_: Any) -> float:
    value = node["v"]
    if value not in ("nan", "inf", "-inf"):
        raise SkeletonError(f"bad float {value!r}")
    return float(value)


def _dec_int(node: dict, *_: Any) -> int:
    value = node["v"]
    if not isinstance(value, str) or len(value) > 10_000:
        raise SkeletonError("bad big integer")
    return int(value)


def _dec_dtype(node: dict, *_: Any) -> torch.dtype:
    # vars, not getattr: torch's module __getattr__ imports submodules (torch._dynamo: seconds)
    value = vars(torch).get(str(node["v"]))
    if not isinstance(value, torch.dtype):
        raise SkeletonError(f"unknown dtype {str(node['v'])[:40]!r}")
    return value


def _dec_device(node: dict, *_: Any) -> torch.device:
    try:
        return torch.device(str(node["v"]))
    except RuntimeError:
        raise SkeletonError(f"bad device {str(node['v'])[:40]!r}") from None


def _dec_ndbytes(node: dict, *_: Any) -> np.ndarray:
    dtype = numpy_dtype(node["dtype"])
    shape = node["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SkeletonError(f"bad array shape {shape!r}")
    data = base64.b64decode(node["v"], validate=True)
    if math.prod(shape) * dtype.itemsize != len(data):
        raise SkeletonError("array shape does not match its bytes")
    return np.frombuffer(bytearray(data), dtype=dtype).reshape(shape)  # writable, byte-exact


def _dec_npscalar(node: dict, *_: Any) -> np.generic:
    dtype = numpy_dtype(node["dtype"])
    data = base64.b64decode(node["v"], validate=True)
    if dtype.itemsize == 0 and dtype.kind in "SU":  # np.str_('') / np.bytes_(b''): dtype <U0 / |S0
        return dtype.type()
    if len(data) != dtype.itemsize:
        raise SkeletonError("numpy scalar size does not match its dtype")
    return np.frombuffer(data, dtype=dtype)[0]


def _dec_pickle(node: dict, _dec: Any, _depth: int, _t: Any, allow_pickle: bool) -> Any:
    if not allow_pickle:
        raise UnsupportedStateError(
            "",
            "the checkpoint holds pickled objects; pass allow_pickle=True to load them (only for trusted files)",
        )
    return pickle.loads(base64.b64decode(node["v"], validate=True))  # noqa: S301 - explicit opt-in


def _dec_ndarray(node: dict, _d: Any, _depth: int, tensor_at: Any, *_: Any) -> np.ndarray:
    return tensor_at(node).numpy()


_DECODERS: dict[Any, Any] = {
    "tensor": lambda node, _d, _depth, tensor_at, *_: tensor_at(node),
    "dtensor": None,  # decoded in unflatten (it needs build_dtensors)
    "ndarray": _dec_ndarray,
    "int": _dec_int,
    "float": _dec_float,
    "tuple": lambda node, dec, depth, *_: tuple(dec(v, depth + 1) for v in _as_list(node["v"])),
    "dict": _dec_dict,
    "odict": _dec_dict,
    "bytes": lambda node, *_: base64.b64decode(node["v"], validate=True),
    "dtype": _dec_dtype,
    "size": lambda node, *_: _dec_size(node["v"]),
    "device": _dec_device,
    "ndbytes": _dec_ndbytes,
    "npscalar": _dec_npscalar,
    "pickle": _dec_pickle,
}


def _as_list(value: Any) -> list:
    if not isinstance(value, list):
        raise SkeletonError("expected a list")
    return value


def _dec_size(value: Any) -> torch.Size:
    dims = _int_list(value)
    if not all(-(2**63) <= d < 2**63 for d in dims):  # torch.Size would take them, then fail in use
        raise SkeletonError(f"torch.Size dimension out of the int64 range in {str(dims)[:80]}")
    return torch.Size(dims)


def _int_list(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise SkeletonError(f"expected a list of integers, got {value!r}")
    return value


def tensor_count(skeleton: Any) -> int:
    """Number of distinct tensor indices the skeleton refers to (for validation)."""
    found: set[int] = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if node.get(_TAG) in ("tensor", "dtensor", "ndarray") and type(node.get("i")) is int:
                found.add(node["i"])
            for v in node.values():
                walk(v)

    walk(skeleton)
    return len(found)


def tensors_in(value: Any, unwrap: Callable[[Any], Any] | None = None) -> list[torch.Tensor]:
    """The tensors of a nested state (dicts, lists, tuples), in order, DTensors as they are;
    ``unwrap`` is applied to every value first (a wrapper gives its contents)."""
    if unwrap is not None:
        value = unwrap(value)
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v, unwrap)]
    return []
