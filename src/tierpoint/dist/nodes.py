"""Nodes: this process's node identity, which node every rank lives on, and the groups a step
coordinates through node by node.

Call order: :func:`node_id` and :func:`known_node_layout` any time (no collective);
:func:`node_layout` and :func:`node_groups` are collective on their first call (every rank, the
same call site) and cached per default process group; :func:`gather_by_node` (collective) on top
of them.

Invariants: nodes are ordered by their lowest rank, a node's leader is its lowest rank; a rank
joins only its own node's group and, on a leader, the leaders' group (local synchronisation: no
rank waits for groups it is not in); :func:`gather_by_node` moves O(nodes) bytes per rank when a
merge is about as small as one rank's object.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .group import drop_at_exit, run_collective
from .messages import all_gather_json, broadcast_json, gather_json
from .ranks import is_distributed
from .timeouts import default_timeout


def node_id() -> str:
    """This process's node identity.

    ``TIERPOINT_NODE_ID`` wins; otherwise the hostname, qualified by torchrun's ``GROUP_RANK`` when set
    (so that several simulated nodes on one machine count as different nodes).
    """
    explicit = os.environ.get("TIERPOINT_NODE_ID")
    if explicit:
        return explicit
    host = socket.gethostname()
    group_rank = os.environ.get("GROUP_RANK")
    return f"{host}/{group_rank}" if group_rank is not None else host


@dataclass(frozen=True)
class NodeLayout:
    """Which node every rank lives on."""

    node_of_rank: tuple[str, ...]
    rank: int

    @property
    def nodes(self) -> list[str]:
        """Distinct node ids in order of their lowest rank."""
        return list(dict.fromkeys(self.node_of_rank))

    @property
    def node_index(self) -> int:
        return self.nodes.index(self.node_of_rank[self.rank])

    @property
    def local_ranks(self) -> list[int]:
        """Global ranks on this rank's node, ascending."""
        me = self.node_of_rank[self.rank]
        return [r for r, n in enumerate(self.node_of_rank) if n == me]

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def local_world_size(self) -> int:
        return len(self.local_ranks)


_layouts: dict[int, NodeLayout] = {}


def node_layout(what: str = "gather node ids") -> NodeLayout:
    """Every rank's node id (gathered once per process group, then cached). Collective on first
    call (``what``: the step it is part of, named in a coordination error)."""
    if not is_distributed():
        return NodeLayout((node_id(),), 0)
    key = id(dist.distributed_c10d._get_default_group())
    layout = _layouts.get(key)
    if layout is None:
        layout = NodeLayout(tuple(all_gather_json(node_id(), what)), dist.get_rank())
        _layouts[key] = layout
    return layout


def known_node_layout() -> NodeLayout | None:
    """The layout :func:`node_layout` gathered for the current default group, or ``None`` when no
    call gathered it yet (never collective)."""
    if not is_distributed():
        return node_layout()
    return _layouts.get(id(dist.distributed_c10d._get_default_group()))


@dataclass(frozen=True)
class NodeGroups:
    """The groups a step coordinates through node by node: this rank's node (``node``), the nodes'
    leaders (``leaders``, ``None`` on other ranks) and the global rank of this node's leader (its
    lowest rank)."""

    node: Any
    leaders: Any
    leader: int


_node_groups: dict[int, NodeGroups] = {}
drop_at_exit(_node_groups)


def node_groups() -> NodeGroups:
    """This rank's :class:`NodeGroups` (gloo; created once per process group, then cached).
    Collective on first call: every rank calls it, each joins only its node's group and, on a
    leader, the leaders' group (local synchronisation: no rank waits for groups it is not in)."""
    key = id(dist.distributed_c10d._get_default_group())
    groups = _node_groups.get(key)
    if groups is None:
        layout = node_layout()
        first: dict[str, int] = {}
        for r, node in enumerate(layout.node_of_rank):
            first.setdefault(node, r)
        leader = first[layout.node_of_rank[layout.rank]]

        def create(ranks: list[int], what: str) -> Any:
            return run_collective(
                what,
                dist.new_group,
                ranks,
                backend="gloo",
                timeout=default_timeout(),
                use_local_synchronization=True,
            )

        node = create(layout.local_ranks, "creating tierpoint's node group")
        leaders = None
        if layout.rank == leader:
            leaders = create(sorted(first.values()), "creating tierpoint's node leaders' group")
        groups = _node_groups[key] = NodeGroups(node, leaders, leader)
    return groups


def gather_by_node(obj: Any, merge: Callable[[list[Any]], Any], what: str) -> list[Any]:
    """Every node's ``merge`` of its ranks' ``obj`` (JSON, in rank order), one per node in order
    of their lowest rank, on every rank. Collective, in three steps: each node's objects go to its
    leader, the leaders exchange their merges, each leader passes them on to its node. A leader
    receives its node's objects and every node's merge, any other rank every node's merge: O(nodes)
    bytes per rank when a merge is about as small as one rank's object."""
    if not is_distributed():
        return [merge([json.loads(json.dumps(obj))])]
    groups = node_groups()
    mine = gather_json(obj, groups.leader, what, groups.node)
    merged = None
    if groups.leaders is not None:
        assert mine is not None
        merged = all_gather_json(merge(mine), what, groups.leaders)
    return broadcast_json(merged, groups.leader, what, groups.node)
