"""DTensors in a rank's own part: stored as this rank's local shard plus a JSON description of how
it was sharded, rebuilt on the same device mesh when loaded.

Call order: :func:`tierpoint.tree.flatten` calls :func:`local_shard` and :func:`describe` for each
DTensor it meets (the mesh is remembered in this process); :func:`tierpoint.tree.unflatten` calls
:func:`rebuild` with the loaded local shard and that description, or only
:func:`check_description` when it validates a part (of any rank, in any process: no mesh is
needed). The local tier builds DTensors when the loaded state is first used
(``ta_state_dict.state_dict``), on every rank at the same point.

Description: ``{"device_type", "mesh": nested list of ranks, "dim_names", "placements", "shape",
"stride"}``; placements are ``["shard", dim]``, ``["replicate"]`` or ``["partial", op]`` (other kinds,
such as the strided shards of FSDP2 combined with tensor parallelism, are refused on save by name).

Invariants:
- ``rebuild`` treats the description as untrusted: every field is checked (ranks inside the world,
  this rank in the mesh, placements known, the local shard's shape the one the placements give this
  rank) before anything is built; a mismatch raises :class:`SkeletonError` naming it.
- This module sits below :mod:`tierpoint.tree` and never imports it: :class:`SkeletonError` lives
  here because both raise it (``tierpoint.tree.SkeletonError`` is the same class).
- The mesh is the one the DTensor was saved from when this process still has it (saved here, or
  :func:`remember_mesh`); otherwise it is created from the description: for a mesh spanning every
  rank in one dimension no process group is made, for others ``DeviceMesh`` creates its groups,
  which is collective (every rank loads its part at once, so every rank takes part).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .errors import UnsupportedStateError

MAX_MESH_RANKS = 1 << 24

_meshes: dict[tuple, Any] = {}
"""Device meshes this process saved DTensors from (or was given), by their description."""


class SkeletonError(ValueError):
    """The skeleton read from a file is malformed (the caller wraps it with the file's name)."""


def is_dtensor(obj: Any) -> bool:
    return type(obj).__name__ == "DTensor" and hasattr(obj, "device_mesh")


def local_shard(dt: Any) -> torch.Tensor:
    """The DTensor's local tensor (the same object on every call, so tied DTensors stay tied)."""
    local = getattr(dt, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else dt.to_local()


def _mesh_key(device_type: str, ranks: list, names: list | None) -> tuple:
    return (device_type, repr(ranks), tuple(names) if names is not None else None)


def remember_mesh(mesh: Any) -> None:
    """Let :func:`rebuild` use ``mesh`` for DTensors saved from an equal mesh (no new groups)."""
    names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    _meshes[_mesh_key(mesh.device_type, mesh.mesh.tolist(), names)] = mesh


def describe(dt: Any, path: str) -> dict[str, Any]:
    """How ``dt`` is sharded, as JSON data; refuses placements it cannot rebuild."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    placements: list[list[Any]] = []
    for p in dt.placements:
        if type(p) is Shard:
            placements.append(["shard", p.dim])
        elif type(p) is Replicate:
            placements.append(["replicate"])
        elif type(p) is Partial and isinstance(p.reduce_op, str):
            placements.append(["partial", p.reduce_op])
        else:
            raise UnsupportedStateError(
                path, f"DTensor placement {p!r} is not supported by the local tier"
            )
    mesh = dt.device_mesh
    remember_mesh(mesh)
    return {
        "device_type": mesh.device_type,
        "mesh": mesh.mesh.tolist(),
        "dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "placements": placements,
        "shape": list(dt.shape),
        "stride": list(dt.stride()),
    }


def check_description(local: torch.Tensor, desc: Any) -> tuple[list[int], list[int], list[int]]:
    """The form of ``desc`` checked without a mesh (any rank, any time): its global shape and
    stride, and the ranks of its mesh."""
    if not isinstance(desc, dict):
        raise _bad("a DTensor node needs a description")
    shape, stride = _ints(desc.get("shape"), "shape"), _ints(desc.get("stride"), "stride")
    if len(shape) != len(stride) or len(shape) != local.dim():
        raise _bad(
            f"DTensor of {len(shape)} dims (stride {len(stride)}) with a {local.dim()}-dim shard"
        )
    ranks = _flat_ranks(desc.get("mesh"), 0)
    mesh_dims, nested = 0, desc.get("mesh")
    while isinstance(nested, list):
        mesh_dims, nested = mesh_dims + 1, nested[0]
    _placements(desc.get("placements"), mesh_dims, len(shape))
    return shape, stride, ranks


def rebuild(local: torch.Tensor, desc: Any) -> Any:
    """The DTensor described by ``desc`` with ``local`` as this rank's shard (see the module
    docstring for the checks)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, stride, _ = check_description(local, desc)
    mesh = _mesh(desc)
    placements = _placements(desc.get("placements"), mesh.ndim, len(shape))
    try:
        expected, _ = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    except (RuntimeError, OverflowError) as e:  # sizes beyond int64 once sharded
        raise _bad(f"DTensor shape {str(shape)[:60]} cannot be sharded on its mesh ({e})") from None
    if tuple(expected) != tuple(local.shape):
        raise SkeletonError(
            f"the local shard is {list(local.shape)}, but a {shape} DTensor sharded as "
            f"{desc.get('placements')} on mesh {desc.get('mesh')} gives rank {dist.get_rank()} "
            f"{list(expected)}"
        )
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=tuple(stride)
    )


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise _bad(f"DTensor {what} {str(value)[:60]} is not a list of non-negative ints")
    return value


def _bad(message: str) -> Exception:
    return SkeletonError(message)


def _mesh(desc: dict[str, Any]) -> Any:
    device_type, ranks, names = desc.get("device_type"), desc.get("mesh"), desc.get("dim_names")
    if not isinstance(device_type, str) or device_type not in ("cpu", "cuda", "meta", "xpu"):
        raise _bad(f"DTensor mesh device type {str(device_type)[:20]!r} is not known")
    if not (dist.is_available() and dist.is_initialized()):
        raise UnsupportedStateError(
            "",
            "the part holds DTensors: loading them needs torch.distributed initialised with the "
            "ranks of their device mesh",
        )
    backend = getattr(torch, device_type, None)
    if device_type in ("cuda", "xpu") and not (backend is not None and backend.is_available()):
        raise UnsupportedStateError(  # DeviceMesh would fail an assertion
            "",
            f"the part holds DTensors on a {device_type} device mesh, and this process has no "
            f"{device_type} device",
        )
    flat_ranks = _flat_ranks(ranks, 0)
    world = dist.get_world_size()
    if not flat_ranks or len(set(flat_ranks)) != len(flat_ranks) or max(flat_ranks) >= world:
        raise _bad(f"DTensor mesh {str(ranks)[:80]} is not a set of distinct ranks below {world}")
    if dist.get_rank() not in flat_ranks:
        raise _bad(f"rank {dist.get_rank()} is not in the DTensor mesh {str(ranks)[:80]}")
    if names is not None and not (
        isinstance(names, list) and all(isinstance(n, str) for n in names)
    ):
        raise _bad("DTensor mesh dim names must be a list of strings")
    key = _mesh_key(device_type, ranks, names)
    mesh = _meshes.get(key)
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        tensor = torch.tensor(ranks, dtype=torch.int64)
        if names is not None and len(names) != tensor.dim():
            raise _bad(f"{len(names)} dim names for a {tensor.dim()}-dim mesh")
        mesh = DeviceMesh(device_type, tensor, mesh_dim_names=tuple(names) if names else None)
        _meshes[key] = mesh
    return mesh


def _flat_ranks(ranks: Any, depth: int) -> list[int]:
    """The ranks of a nested-list mesh, checked to be a regular array of ints."""
    if depth > 8 or not isinstance(ranks, list) or not ranks:
        raise _bad("DTensor mesh must be a non-empty nested list of ranks, at most 8 dims")
    if all(type(r) is int and r >= 0 for r in ranks):
        return list(ranks)
    parts = [_flat_ranks(r, depth + 1) for r in ranks]
    if len({len(p) for p in parts}) != 1 or sum(map(len, parts)) > MAX_MESH_RANKS:
        raise _bad("DTensor mesh is not a regular array of ranks")
    return [r for p in parts for r in p]


def _placements(value: Any, mesh_dims: int, tensor_dims: int) -> list[Any]:
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    if not isinstance(value, list) or len(value) != mesh_dims:
        raise _bad(f"DTensor needs one placement per mesh dim ({mesh_dims})")
    out: list[Any] = []
    for p in value:
        if p == ["replicate"]:
            out.append(Replicate())
        elif isinstance(p, list) and len(p) == 2 and p[0] == "shard" and type(p[1]) is int:
            if not 0 <= p[1] < tensor_dims:
                raise _bad(f"DTensor shards dim {p[1]} of a {tensor_dims}-dim tensor")
            out.append(Shard(p[1]))
        elif isinstance(p, list) and len(p) == 2 and p[0] == "partial" and p[1] in _REDUCE_OPS:
            out.append(Partial(p[1]))
        else:
            raise _bad(f"unknown DTensor placement {str(p)[:40]}")
    return out


_REDUCE_OPS = ("sum", "avg", "max", "min", "product")
