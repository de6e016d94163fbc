"""Replication strategies: which ranks hold copies of which rank's local part.

:class:`CliqueReplicationStrategy` groups ranks into cliques ``n, n+J, ..., n+(F-1)J`` (J the
replication jump, F the replication factor); every member holds the parts of every other member, so a
clique survives the loss of F-1 of its members. The default jump is the number of ranks per node,
found at run time, so that with the default every clique spans F different nodes.

Call order: construct on every rank after ``torch.distributed`` is initialised (the eager strategy
sets itself up there: one gather of node ids and the creation of its gloo group, both collective), or
use :class:`LazyCliqueReplicationStrategy`, which does the same on first use (inside the manager's
collective ``save`` / ``load`` / ``find_latest``). Then hand it to
:class:`~tierpoint.local.LocalCheckpointManager` as ``repl_strategy``.

A strategy written by the user subclasses :class:`ReplicationStrategy` (NVRx's base class) and
implements NVRx's ``replicate``; the manager wraps it in :class:`UserReplication`.

Invariants:
- Parameters are checked against the world size before anything is exchanged; a bad combination
  raises a :class:`CheckpointingError` naming the values.
- Members of one clique are checked to sit on different nodes (node ids from
  :func:`tierpoint.dist.node_id`): a warning, or :class:`SameMachineReplicationException` with
  ``strict=True``.
- Replica traffic runs on the strategy's own gloo group, never on the coordination group, so a
  replication running in the background cannot interleave with the manager's collectives; replicas
  restored in the background after a load run on a second group of their own
  (:attr:`CliqueReplicationStrategy.restore_group`), so they never share a group with a save.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

import torch.distributed as dist

from .. import dist as tpdist
from ..errors import CheckpointingError, SameMachineReplicationException

logger = logging.getLogger("tierpoint")


def _positive_int(name: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise CheckpointingError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class _ReplicaGroups:
    """The gloo groups a strategy's replica traffic runs on, created by ``setup()`` on first use."""

    _group: Any = None
    _restore_group: Any = None

    def setup(self) -> None:
        raise NotImplementedError

    def _drop_groups(self) -> None:
        """Free the groups and forget them (the next use creates new ones)."""
        for group in (self._group, self._restore_group):
            tpdist.destroy_group(group)
        self._group = self._restore_group = None

    @property
    def group(self) -> Any:
        """The gloo group replica traffic runs on (set up on first use)."""
        self.setup()
        return self._group

    @property
    def restore_group(self) -> Any:
        """The gloo group replicas restored in the background after a load run on."""
        self.setup()
        return self._restore_group


class CliqueReplicationStrategy(_ReplicaGroups):
    """Replicate each rank's part to the other members of its clique (see the module docstring).

    Args:
        replication_jump: distance J between clique members (default: ranks per node, at run time).
        replication_factor: clique size F (copies of each part, counting the original).
        strict: raise instead of warning when a clique has two members on one node.
    """

    lazy = False

    def __init__(
        self,
        replication_jump: int | None = None,
        replication_factor: int = 2,
        *,
        strict: bool = False,
    ) -> None:
        if replication_jump is not None:
            _positive_int("replication_jump", replication_jump)
        self.replication_factor = _positive_int("replication_factor", replication_factor)
        self._requested_jump = replication_jump
        self.strict = strict
        self.replication_jump: int | None = None
        self.world_size: int | None = None
        self._group: Any = None
        self._restore_group: Any = None
        if not self.lazy and tpdist.is_distributed():
            self.setup()

    @staticmethod
    def unfit(factor: int, jump: int | None = None) -> str | None:
        """Why this job's nodes cannot hold ``factor`` copies of each part, ``jump`` ranks apart
        (default: ranks per node), or ``None`` when they can. Collective on first use (the node
        layout)."""
        layout = tpdist.node_layout()
        nodes, world = layout.nodes, len(layout.node_of_rank)
        sizes = sorted({layout.node_of_rank.count(n) for n in nodes})
        if len(nodes) < factor:
            return f"the job spans {len(nodes)} node(s)"
        if jump is None and len(sizes) > 1:
            return f"its nodes run different numbers of ranks {sizes}"
        if world % ((jump or sizes[0]) * factor):
            return f"its {world} ranks on {len(nodes)} nodes do not form cliques of {factor}"
        return None

    @classmethod
    def for_job(cls, factor: int, jump: int | None = None) -> CliqueReplicationStrategy | None:
        """The strategy for ``factor`` copies, or ``None`` (one copy, a job of one rank, or with a
        WARNING where this job's nodes cannot hold the copies: a job restarted on the nodes left
        after one was lost still runs, unreplicated). Collective (the node layout)."""
        if factor < 2 or tpdist.get_world_size() < 2:
            return None
        why = cls.unfit(factor, jump)
        if why is None:
            return cls(jump, factor)
        if tpdist.get_rank() == 0:
            logger.warning(
                "replication_factor=%d but %s: local checkpoints are not replicated (a lost "
                "node's part comes back from the persistent tier)",
                factor,
                why,
            )
        return None

    @classmethod
    def from_replication_params(
        cls, replication_jump: int | None = None, replication_factor: int = 2, **kwargs: Any
    ) -> CliqueReplicationStrategy:
        """NVRx-compatible constructor."""
        return cls(replication_jump, replication_factor, **kwargs)

    # ------------------------------------------------------------------------------ set-up

    def setup(self) -> None:
        """Resolve the jump, validate, check nodes, create the groups. Collective; idempotent."""
        world = tpdist.get_world_size()
        if self.world_size == world and (self._group is not None or not tpdist.is_distributed()):
            return
        layout = tpdist.node_layout()
        jump = self._requested_jump
        if self.replication_factor == 1:
            jump = 1  # one copy: every rank is its own clique, whatever the jump and the nodes
        elif jump is None:
            sizes = {layout.node_of_rank.count(n) for n in layout.nodes}
            if len(sizes) != 1:
                raise CheckpointingError(
                    f"cannot derive replication_jump: nodes run different numbers of ranks {sorted(sizes)}; "
                    "pass replication_jump explicitly"
                )
            jump = sizes.pop()
        factor = self.replication_factor
        self._check_same_settings(jump, factor)
        if world % (jump * factor):
            derived = ""
            if self._requested_jump is None:
                derived = (
                    f" (replication_jump was not given: it is the {jump} ranks per node found on "
                    f"the job's {len(layout.nodes)} node(s); pass replication_jump, or run on a "
                    f"multiple of {factor} nodes)"
                )
            raise CheckpointingError(
                f"world size {world} is not divisible by replication_jump * replication_factor "
                f"= {jump} * {factor} = {jump * factor}{derived}"
            )
        self.replication_jump, self.world_size = jump, world
        self._check_nodes(layout.node_of_rank)
        if tpdist.is_distributed():
            self._group = dist.new_group(backend="gloo", timeout=tpdist.default_timeout())
            self._restore_group = dist.new_group(backend="gloo", timeout=tpdist.default_timeout())
            tpdist.drop_at_exit(self, "_group", "_restore_group")

    @staticmethod
    def _check_same_settings(jump: int, factor: int) -> None:
        """Every rank must replicate with the same jump and factor: otherwise the ranks wait for
        copies their peers never send, and each save fails only after the coordination timeout,
        naming no cause. One all-reduce of four integers, at set-up; raises on every rank alike."""
        if not tpdist.is_distributed():
            return
        low = tpdist.reduce_ints(
            [jump, -jump, factor, -factor], "min", "replication: comparing replication settings"
        )
        jumps, factors = (low[0], -low[1]), (low[2], -low[3])
        if jumps[0] != jumps[1] or factors[0] != factors[1]:
            raise CheckpointingError(
                "ranks replicate with different settings (replication_jump from "
                f"{jumps[0]} to {jumps[1]}, replication_factor from {factors[0]} to {factors[1]}; "
                f"this rank: {jump} and {factor}): every rank must use the same replication_jump "
                "and replication_factor"
            )

    def _check_nodes(self, node_of_rank: tuple[str, ...]) -> None:
        for clique in self.cliques():
            nodes = [node_of_rank[r] for r in clique]
            if len(set(nodes)) < len(nodes):
                message = (
                    f"replication clique {clique} has members on the same node "
                    f"({', '.join(f'rank {r}: {n}' for r, n in zip(clique, nodes))}); losing that node "
                    "loses every copy. Set replication_jump to the number of ranks per node, or give "
                    "each node its own TIERPOINT_NODE_ID / GROUP_RANK"
                )
                if self.strict:
                    raise SameMachineReplicationException(message)
                logger.warning(message)
                return

    def reset(self) -> None:
        """Free and forget the groups (after a failed exchange every rank does this, so all agree;
        a failed save must not leave a group, its sockets and threads behind)."""
        self._drop_groups()
        self.world_size = None

    # ------------------------------------------------------------------------------ cliques

    def clique(self, rank: int) -> list[int]:
        """The members of ``rank``'s clique, ascending (``rank`` included)."""
        self.setup()
        return self._clique(rank)

    def _clique(self, rank: int) -> list[int]:
        jump, factor = self.replication_jump, self.replication_factor
        assert jump is not None
        block = rank // (jump * factor) * jump * factor
        return [block + rank % jump + k * jump for k in range(factor)]

    def cliques(self) -> list[list[int]]:
        """Every clique once (after :meth:`setup`)."""
        world = self.world_size or tpdist.get_world_size()
        seen: dict[int, list[int]] = {}
        for r in range(world):
            c = self._clique(r)
            seen.setdefault(c[0], c)
        return list(seen.values())

    def holders(self, origin: int) -> list[int]:
        """Ranks that keep a replica of ``origin``'s part (also the origins ``origin`` holds)."""
        return [r for r in self.clique(origin) if r != origin]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(replication_jump={self.replication_jump or self._requested_jump}, "
            f"replication_factor={self.replication_factor})"
        )


class LazyCliqueReplicationStrategy(CliqueReplicationStrategy):
    """:class:`CliqueReplicationStrategy` that sets itself up (collectively) on first use."""

    lazy = True


class ReplicationStrategy(ABC):
    """NVRx's base class for a replication strategy written by the user.

    The protocol tierpoint uses is NVRx's ``replicate``: on every save (collectively, on every rank,
    in the training process, before an async save's request is returned, as NVRx does) the manager
    calls ``replicate(local_ckpt, id_)`` with this rank's :class:`TensorAwareStateDict` and its
    :class:`~tierpoint.local.CkptID`; it returns the checkpoints this rank should keep and their ids
    (its own may be among them: it is skipped). Each of the others is written as a replica part
    (checksummed, like any part). On load, tierpoint fetches a missing or corrupt part itself from
    whichever rank holds a verified copy, so ``retrieve_plan`` / ``retrieve_execute`` are not called
    (they are kept, not abstract, so a subclass written for NVRx runs unchanged). A subclass may do
    anything collective in ``replicate``; it must not leave other collectives pending.
    """

    @abstractmethod
    def replicate(self, local_ckpt: Any, id_: Any) -> tuple[list[Any], list[Any]]:
        """The checkpoints (tensor-aware state dicts) this rank keeps, and their ids."""

    def retrieve_plan(self, globally_available_ids: Any, wanted: Any) -> Any:
        """NVRx's retrieval planning; not called by tierpoint (see the class docstring)."""
        raise NotImplementedError("tierpoint plans retrieval itself")

    def retrieve_execute(self, *args: Any, **kwargs: Any) -> Any:
        """NVRx's retrieval; not called by tierpoint (see the class docstring)."""
        raise NotImplementedError("tierpoint retrieves parts itself")


class UserReplication(_ReplicaGroups):
    """The manager's view of a user's strategy (anything with NVRx's ``replicate``): the same
    attributes as :class:`CliqueReplicationStrategy` where the manager needs them. Holders are
    unknown in advance (``holders`` is empty): replicas lost with a node are not restored, the next
    save makes new ones."""

    lazy = True

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.replication_factor = 2  # spares kept per save; refined by each replicate()
        self._group: Any = None
        self._restore_group: Any = None

    @staticmethod
    def accepts(strategy: Any) -> bool:
        return isinstance(strategy, ReplicationStrategy) or callable(
            getattr(strategy, "replicate", None)
        )

    def setup(self) -> None:
        """Create the groups (collective, inside the manager's collective calls)."""
        if self._group is None and tpdist.is_distributed():
            self._group = dist.new_group(backend="gloo", timeout=tpdist.default_timeout())
            self._restore_group = dist.new_group(backend="gloo", timeout=tpdist.default_timeout())
            tpdist.drop_at_exit(self, "_group", "_restore_group")

    def holders(self, origin: int) -> list[int]:
        return []

    def reset(self) -> None:
        self._drop_groups()

    def replicate(self, local_ckpt: Any, ckpt_id: Any) -> list[tuple[Any, tuple[int, int, str]]]:
        """Run the user's ``replicate``; returns ``(checkpoint, (iteration, origin, session))``
        pairs, each checked to be a tensor-aware state dict with a well-formed id."""
        out = self.strategy.replicate(local_ckpt, ckpt_id)
        name = type(self.strategy).__name__
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise CheckpointingError(
                f"{name}.replicate must return (checkpoints, ids), got {type(out).__name__}"
            )
        ckpts, ids = list(out[0]), list(out[1])
        if len(ckpts) != len(ids):
            raise CheckpointingError(
                f"{name}.replicate returned {len(ckpts)} checkpoints but {len(ids)} ids"
            )
        pairs = []
        for ckpt, id_ in zip(ckpts, ids):
            if not (isinstance(id_, (tuple, list)) and len(id_) == 3):
                raise CheckpointingError(f"{name}.replicate returned the id {id_!r}")
            if not callable(getattr(ckpt, "to_flat", None)):
                raise CheckpointingError(
                    f"{name}.replicate returned a {type(ckpt).__name__} for {tuple(id_)}, "
                    "want a TensorAwareStateDict"
                )
            pairs.append((ckpt, (id_[0], id_[1], id_[2])))
        self.replication_factor = max(2, len(pairs))
        return pairs

    def __repr__(self) -> str:
        return f"UserReplication({self.strategy!r})"
