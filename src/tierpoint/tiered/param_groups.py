"""Optimizer parameter groups checked against a checkpoint's before anything is loaded.

An optimizer's ``load_state_dict`` refuses groups of other sizes (parameters split differently,
another number of groups), but only once it is called, after the tiers have copied the tensors
into the model: the restore then fails half done. Neither tier's own check sees it (torch DCP
stores a group's ``params``, a list of integers, as one plain value), so the groups are compared
first: :func:`sizes_of` on the live state's tree (an optimizer's ``state_dict()`` stands where
the optimizer is), against :func:`sizes_of` the loaded local part, or :func:`stored_sizes` of a
persistent step (which loads those lists alone).

An optimizer saved before its first step holds no state: a restore, which gives a fresh
optimizer its state to load into, takes an empty one from such a checkpoint instead
(:func:`without_saved_state`; the local tier: :func:`tierpoint.tiered.state.check_loaded`).

Call order: ``problems(sizes_of(live), sizes_of(loaded) | stored_sizes(...))``.
Invariants: names are torch DCP's fully qualified names (``optimizer``, ``opts.0``); only dicts
shaped like an optimizer's state dict count (``state`` and ``param_groups``, each group with a
``params`` list).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import dcp
from .tree_paths import holds, replaced


def group_sizes(value: Any) -> list[int] | None:
    """The number of parameters in each group of an optimizer state dict; None for anything else."""
    if not isinstance(value, Mapping) or "state" not in value:
        return None
    groups = value.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
    ):
        return None
    return [len(g["params"]) for g in groups]


def sizes_of(tree: Any, name: str = "") -> dict[str, list[int]]:
    """:func:`group_sizes` of every optimizer state dict in ``tree``, by its name."""
    found: dict[str, list[int]] = {}
    sizes = group_sizes(tree)
    if sizes is not None:
        found[name] = sizes
    elif isinstance(tree, (Mapping, list, tuple)):
        items = tree.items() if isinstance(tree, Mapping) else enumerate(tree)
        for key, value in items:
            found |= sizes_of(value, f"{name}.{key}" if name else str(key))
    return found


def stored_sizes(
    live: Mapping[str, list[int]], metadata: Any, path: str, options: Any
) -> dict[str, list[int]]:
    """The group sizes a persistent step holds for the optimizers named in ``live`` (collective:
    loads their ``params`` lists, small plain values; every rank with the same names). Optimizers
    the step holds inside one stored value (torch DCP pickles a tuple whole) are left out."""
    stored = metadata.state_dict_metadata
    wanted: dict[str, None] = {}
    counts = {}
    for name in live:
        if not holds(stored, name):
            continue  # inside a value torch DCP stored whole (a tuple): checked as it loads
        count = 0
        while f"{name}.param_groups.{count}.params" in stored:
            wanted[f"{name}.param_groups.{count}.params"] = None
            count += 1
        counts[name] = count
    if wanted:
        dcp.load(wanted, path, storage_options=options)
    return {
        name: [
            len(v) if isinstance(v := wanted[f"{name}.param_groups.{i}.params"], list) else -1
            for i in range(count)
        ]
        for name, count in counts.items()
    }


def without_saved_state(tree: Any, live: Mapping[str, list[int]], metadata: Any) -> Any:
    """``tree`` (a persistent restore's template) with an empty ``state`` for each optimizer of
    ``live`` whose state the step does not hold (saved before its first step): it loads as such,
    and the optimizer is left without state, as it was saved."""
    stored = metadata.state_dict_metadata
    for name in live:
        has_groups = f"{name}.param_groups.0.params" in stored
        if has_groups and not holds(stored, f"{name}.state"):
            tree = replaced(tree, [*name.split("."), "state"], {})
    return tree


def problems(live: Mapping[str, list[int]], stored: Mapping[str, list[int]]) -> list[str]:
    """A line for each optimizer whose groups differ from the checkpoint's."""
    return [
        f"{name}: optimizer parameter groups of {sizes} parameters in the state, "
        f"{stored.get(name)} in the checkpoint"
        for name, sizes in live.items()
        if name in stored and stored[name] != sizes
    ]
