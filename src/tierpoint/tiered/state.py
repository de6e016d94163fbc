"""A training state as the tiers see it: taken apart for saving, checked and put back in place on
restore.

A *state* is what a training loop hands to :class:`~tierpoint.TieredCheckpointManager`: a dict whose
values are tensors, plain values, nested dicts / lists / tuples of those, objects with
``state_dict()`` / ``load_state_dict()`` (torch DCP's ``Stateful``: modules, optimizers, LR
schedulers, data-loader wrappers, RNG holders), and :class:`RankLocal` wrappers for values that
differ between ranks.

Call order::

    init_optimizers(state)            # restore only: a fresh optimizer gets its (zero) state
    tree = template(state)            # stateful members replaced by their state_dict(), tensors shared
    ... a tier fills ``tree`` in place (tensors copied into, plain values replaced) ...
    apply(state, tree)                # load_state_dict on stateful members, plain values replaced

Saving uses :func:`template` too, then :func:`local_form` (the local tier: DTensors as this rank's
local shards, rank-local values unwrapped) or :func:`persistent_form` (the persistent tier: DTensors
kept for resharding, rank-local values under a per-rank key).

Invariants: :func:`shardings_differ`, :func:`check_loaded` (and, for the persistent tier,
:func:`tierpoint.tiered.restoring.check_against_metadata`) report every difference between the
live state and a checkpoint (another parallel layout, missing or extra keys, other shapes or
dtypes) before anything is copied, so a refused restore leaves the state as it was.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from ..errors import UnsupportedStateError, error_text
from ..tree import tensors_in
from .numpy_values import as_numpy, as_tensors
from .param_groups import group_sizes
from .param_groups import problems as param_group_problems
from .tree_paths import holds

RANK_LOCAL_KEY = "__rank_local__"
"""Where the persistent tier keeps each rank's :class:`RankLocal` values: ``<key>.<rank>.<name>``."""

SHARDING_KEY = "__sharding__"
"""Where the local tier records, per DTensor path, how it was sharded (checked on restore)."""

_MAX_REPORTED = 12
_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


class RankLocal:
    """Marks a value of the state that differs between ranks (RNG states, a per-rank data position).

    The local tier keeps one part per rank anyway; the persistent tier, which stores replicated
    values once, stores each rank's copy under its own key and gives each rank its own back (rank 0's
    when the job restarts with more ranks). Only allowed as a top-level value of the state.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"RankLocal({self.value!r})"


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def init_optimizers(state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    """Give each optimizer of ``state`` that has no state yet its state, by one step with zero
    gradients and a zero learning rate (torch DCP's way: the parameters do not change), so that a
    checkpoint's optimizer state has tensors to load into; restore only (a step counts: Adam's
    bias correction would change if a save did this). One that cannot step so (LBFGS wants a
    closure, SparseAdam sparse gradients) is left as it was. Returns the optimizers initialised."""
    done = []
    for optimizer in optimizers(state) if isinstance(state, Mapping) else []:
        if not optimizer.state and _zero_step(optimizer):
            done.append(optimizer)
    return done


def _zero_step(optimizer: torch.optim.Optimizer) -> bool:
    """torch DCP's ``_init_optim_state``, undone where the step fails; whether the state is made."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        return False
    lrs = [group.get("lr") for group in optimizer.param_groups]
    try:
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        optimizer.step()
        return True
    except Exception:  # noqa: BLE001 - left without state: the restore's check says what differs
        optimizer.state.clear()
        return False
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p in params:
            p.grad = None


def optimizers(state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    """The optimizers among ``state``'s members (nested dicts and ``RankLocal`` included)."""
    return [v for v in _members(state) if isinstance(v, torch.optim.Optimizer)]


def _members(state: Any) -> list[Any]:
    """The values of ``state``'s dicts, lists and tuples, those of stateful members not opened."""
    out = []
    values = state.values() if isinstance(state, Mapping) else state
    for value in values:
        if type(value) in _SCALARS:  # (a long list of numbers costs one check an item)
            continue
        value = value.value if isinstance(value, RankLocal) else value
        if isinstance(value, (Mapping, list, tuple)) and not is_stateful(value):
            out += _members(value)
        else:
            out.append(value)
    return out


def template(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with each stateful member replaced by its ``state_dict()``; containers are new,
    tensors are the live ones (module state dicts alias the parameters). A state that is not a
    dict, a misplaced :class:`RankLocal` or a ``state_dict()`` that raises: UnsupportedStateError."""
    if not isinstance(state, Mapping):
        raise UnsupportedStateError("", f"the state must be a dict, got {type(state).__name__}")
    return {key: _template(value, str(key), top=True) for key, value in state.items()}


def template_or_refusal(state: Any) -> tuple[dict[str, Any], UnsupportedStateError | None]:
    """:func:`template`, or ``{}`` and why this rank refused ``state``: the caller's first
    agreement raises that on every rank (the other ranks would otherwise wait in it)."""
    try:
        return template(state), None
    except UnsupportedStateError as e:
        return {}, e


def _template(value: Any, path: str, top: bool = False) -> Any:
    if isinstance(value, RankLocal):
        if not top:
            raise UnsupportedStateError(path, "RankLocal is only allowed as a top-level value")
        return RankLocal(_template(value.value, path))
    if isinstance(value, torch.Tensor):
        return value
    if is_stateful(value):
        try:
            taken = value.state_dict()
        except Exception as e:  # noqa: BLE001 - named, and agreed by the caller
            raise UnsupportedStateError(path, f"state_dict() raised {error_text(e)}") from e
        return _template(taken, path)
    if isinstance(value, Mapping):
        return {k: _template(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_template(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_template(v, f"{path}[{i}]") for i, v in enumerate(value))
    return value


def local_form(tree: dict[str, Any]) -> dict[str, Any]:
    """What the local tier stores: DTensors as this rank's local shard (their mesh and placements
    under :data:`SHARDING_KEY`), rank-local values unwrapped."""
    sharding: dict[str, str] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, RankLocal):
            return walk(value.value, path)
        if is_dtensor(value):
            sharding[path] = _sharding_of(value)
            return value.to_local()
        if isinstance(value, Mapping):
            return {k: walk(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, f"{path}[{i}]") for i, v in enumerate(value))
        return value

    out = {key: walk(value, str(key)) for key, value in tree.items()}
    out[SHARDING_KEY] = sharding
    return out


def _sharding_of(t: Any) -> str:
    mesh = t.device_mesh
    return f"mesh {tuple(mesh.mesh.shape)} ranks {mesh.mesh.flatten().tolist()} placements {t.placements}"


def persistent_form(
    tree: dict[str, Any],
    rank: int,
    made: list[torch.Tensor] | None = None,
    stored: Collection[str] | None = None,
) -> dict[str, Any]:
    """What the persistent tier stores: rank-local values under ``__rank_local__.<rank>``, numpy
    values as tensors and Python numbers (:mod:`~tierpoint.tiered.numpy_values`; the tensors
    made from arrays are appended to ``made``).

    ``stored`` (restoring: the names a checkpoint holds) lets a value wrapped in
    :class:`RankLocal` since the save load its one copy, and a value no longer wrapped load this
    rank's copy (rank 0's where it has none)."""
    out: dict[str, Any] = {}
    by_rank: dict[str, dict[str, Any]] = {}
    for key, value in tree.items():
        ranked = isinstance(value, RankLocal)
        value = value.value if ranked else value
        holder = str(rank) if ranked else None
        if stored is not None:
            holder = _holder(str(key), holder, rank, stored)
        if holder is None:
            out[key] = value
        else:
            by_rank.setdefault(holder, {})[key] = value
    if by_rank:
        out[RANK_LOCAL_KEY] = by_rank
    return as_tensors(out, made)


def _holder(key: str, holder: str | None, rank: int, stored: Collection[str]) -> str | None:
    """Where a checkpoint holds ``key``: ``holder`` (the live state's way) if it is there, else
    plain (``None``) or under a rank (this one first, then rank 0)."""
    candidates = [holder, None, str(rank), "0"]
    for candidate in candidates:
        name = key if candidate is None else f"{RANK_LOCAL_KEY}.{candidate}.{key}"
        if holds(stored, name):
            return candidate
    return holder


def from_persistent_form(tree: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Put the values of a loaded :func:`persistent_form` back into ``tree``, each wrapped in
    :class:`RankLocal` where ``tree`` wraps it, wherever the checkpoint held it."""
    values = {k: v for k, v in loaded.items() if k != RANK_LOCAL_KEY}
    for by_rank in loaded.get(RANK_LOCAL_KEY, {}).values():
        values |= by_rank
    for key, value in values.items():
        live = tree.get(key)
        if isinstance(live, RankLocal):
            tree[key] = RankLocal(as_numpy(value, live.value))
        else:
            tree[key] = as_numpy(value, live)


def shardings_differ(live: dict[str, Any], loaded: dict[str, Any]) -> bool:
    """Whether ``live`` (a :func:`local_form`) and a loaded local part hold DTensors on other meshes
    or placements, or DTensors where the other holds plain tensors (another parallel layout)."""
    return loaded.get(SHARDING_KEY, {}) != live.get(SHARDING_KEY, {})


def check_loaded(live: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    """Every difference between ``live`` (a :func:`local_form`) and a loaded local part of the same
    sharding (:func:`shardings_differ`): keys, shapes, dtypes, and a tensor, dict or list of tensors
    saved where a plain value is now (plain over plain replaces it, as in the persistent tier)."""
    problems: list[str] = []
    unsharded = [{k: v for k, v in t.items() if k != SHARDING_KEY} for t in (live, loaded)]
    _compare(*unsharded, "", problems)
    return problems


def _compare(live: Any, loaded: Any, path: str, problems: list[str]) -> None:
    if isinstance(live, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            problems.append(
                f"{path}: a tensor in the state, {type(loaded).__name__} in the checkpoint"
            )
        elif live.shape != loaded.shape or live.dtype != loaded.dtype:
            problems.append(
                f"{path}: {live.dtype} {tuple(live.shape)} in the state, "
                f"{loaded.dtype} {tuple(loaded.shape)} in the checkpoint"
            )
    elif isinstance(live, Mapping):
        if not isinstance(loaded, Mapping):
            problems.append(
                f"{path}: a dict in the state, {type(loaded).__name__} in the checkpoint"
            )
            return
        sizes = group_sizes(live)
        if sizes is not None:
            problems += param_group_problems({path: sizes}, {path: group_sizes(loaded)})
            if loaded.get("state") == {}:  # saved before its first step: loads as such
                live = {k: v for k, v in live.items() if k != "state"}
                loaded = {k: v for k, v in loaded.items() if k != "state"}
        missing = [k for k in live if k not in loaded]
        extra = [k for k in loaded if k not in live]
        if missing:
            problems.append(f"{path or '<root>'}: not in the checkpoint: {listed(missing)}")
        if extra:
            problems.append(f"{path or '<root>'}: only in the checkpoint: {listed(extra)}")
        for k in live:
            if k in loaded:
                _compare(live[k], loaded[k], f"{path}.{k}" if path else str(k), problems)
    elif isinstance(live, (list, tuple)) and _holds_tensors(live):
        if not isinstance(loaded, (list, tuple)) or len(loaded) != len(live):
            problems.append(f"{path}: {len(live)} entries in the state, other in the checkpoint")
            return
        for i, (a, b) in enumerate(zip(live, loaded)):
            _compare(a, b, f"{path}[{i}]", problems)
    elif (kind := _structure(loaded)) and not (
        isinstance(live, list | tuple) and isinstance(loaded, list | tuple)
    ):  # (as in the persistent tier; a list of plain data takes a saved list's items)
        problems.append(f"{path}: {type(live).__name__} in the state, {kind} in the checkpoint")


def _structure(value: Any) -> str:
    """What ``value`` is when it is more than a plain value ("": it is not)."""
    if isinstance(value, torch.Tensor | Mapping):
        return "a tensor" if isinstance(value, torch.Tensor) else "a dict"
    tensors = isinstance(value, list | tuple) and _holds_tensors(value)
    return "a list holding tensors" if tensors else ""


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensors of a tree (dicts, lists, tuples, :class:`RankLocal`), in order."""
    return tensors_in(tree, lambda v: v.value if isinstance(v, RankLocal) else v)


def has_dtensor(tree: Any) -> bool:
    return any(is_dtensor(t) for t in tensors_of(tree))


def nbytes(tree: Any) -> int:
    """Bytes of this rank's tensors (a DTensor's local shard)."""
    local = (t.to_local() if is_dtensor(t) else t for t in tensors_of(tree))
    return sum(t.numel() * t.element_size() for t in local)


def _holds_tensors(value: Any) -> bool:
    return bool(tensors_of(value))


def listed(keys: list[Any]) -> str:
    """``keys`` as text, the first few of a long list."""
    shown = ", ".join(map(str, keys[:_MAX_REPORTED]))
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > _MAX_REPORTED else "")


def copy_into(live: Any, loaded: Any) -> Any:
    """Copy a checked ``loaded`` tree into ``live`` (a :func:`local_form`'s source tree: DTensors
    receive into their local shard); returns the value to keep at this place."""
    if isinstance(live, RankLocal):
        return RankLocal(copy_into(live.value, loaded))
    if isinstance(live, torch.Tensor):
        target = live.to_local() if is_dtensor(live) else live
        with torch.no_grad():
            target.copy_(loaded)
        return live
    if isinstance(live, dict):
        if group_sizes(live) is not None and loaded.get("state") == {}:
            return loaded  # an optimizer saved before its first step (see check_loaded)
        for k in list(live):
            live[k] = copy_into(live[k], loaded[k])
        return live
    if isinstance(live, list) and _holds_tensors(live):
        for i in range(len(live)):
            live[i] = copy_into(live[i], loaded[i])
        return live
    if isinstance(live, tuple) and _holds_tensors(live):
        return tuple(copy_into(a, b) for a, b in zip(live, loaded))
    return loaded


def apply(state: dict[str, Any], tree: Mapping[str, Any]) -> None:
    """Put a filled :func:`template` back into ``state``: ``load_state_dict`` on stateful members
    (also in lists and tuples), plain values replaced, tensors (already filled in place) left as
    they are; dicts and lists are filled in place (a dict saved with other keys takes the saved
    ones), tuples rebuilt as the live one's type (a named tuple stays one: both tiers store it as
    a plain tuple)."""
    for key in list(state):
        state[key] = _apply(state[key], tree[key])


def _apply(value: Any, filled: Any) -> Any:
    if isinstance(value, RankLocal):
        inner = filled.value if isinstance(filled, RankLocal) else filled
        value.value = _apply(value.value, inner)
        return value
    if isinstance(value, torch.Tensor):
        if filled is not value:
            with torch.no_grad():
                (value.to_local() if is_dtensor(value) else value).copy_(
                    filled.to_local() if is_dtensor(filled) else filled
                )
        return value
    if is_stateful(value):
        value.load_state_dict(filled)
        return value
    if isinstance(value, dict) and isinstance(filled, Mapping):
        if value.keys() == filled.keys():
            for k in list(value):
                value[k] = _apply(value[k], filled[k])
        else:  # an item of a list of plain data, saved with other keys (neither tier compares them)
            items = {k: _apply(value[k], f) if k in value else f for k, f in filled.items()}
            value.clear()
            value.update(items)
        return value
    if isinstance(value, (list, tuple)) and isinstance(filled, (list, tuple)):
        if len(value) == len(filled):  # (else a plain value replaced: the check let it pass)
            items = [_apply(v, f) for v, f in zip(value, filled)]
            if isinstance(value, list):
                value[:] = items
                return value
            return type(value)._make(items) if hasattr(value, "_make") else tuple(items)
    return filled


__all__ = ["RankLocal"]
