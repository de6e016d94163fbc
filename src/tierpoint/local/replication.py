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
from typing import Any

import torch.distributed as dist

from .. import dist as tpdist
from ..errors import CheckpointingError, SameMachineReplicationException

logger = logging.getLogger("tierpoint")


def _positive_int(name: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise CheckpointingError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class CliqueReplicationStrategy:
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

    @classmethod
    def from_replication_params(
        cls, replication_jump: int | None = None, replication_factor: int = 2, **kwargs: Any
    ) -> CliqueReplicationStrategy:
        """NVRx-compatible constructor."""
        return cls(replication_jump, replication_factor, **kwargs)

    # ------------------------------------------------------------------------------ set-up

    def setup(self) -> None:
        """Resolve the jump, validate, check nodes, create the group. Collective; idempotent."""
        world = tpdist.get_world_size()
        if self.world_size == world and (self._group is not None or not tpdist.is_distributed()):
            return
        layout = tpdist.node_layout()
        jump = self._requested_jump
        if jump is None:
            sizes = {layout.node_of_rank.count(n) for n in layout.nodes}
            if len(sizes) != 1:
                raise CheckpointingError(
                    f"cannot derive replication_jump: nodes run different numbers of ranks {sorted(sizes)}; "
                    "pass replication_jump explicitly"
                )
            jump = sizes.pop()
        factor = self.replication_factor
        if world % (jump * factor):
            raise CheckpointingError(
                f"world size {world} is not divisible by replication_jump * replication_factor "
                f"= {jump} * {factor} = {jump * factor}"
            )
        self.replication_jump, self.world_size = jump, world
        self._check_nodes(layout.node_of_rank)
        if tpdist.is_distributed():
            self._group = dist.new_group(backend="gloo", timeout=tpdist.default_timeout())
            self._restore_group = dist.new_group(backend="gloo", timeout=tpdist.default_timeout())

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

    def reset(self) -> None:
        """Forget the groups (after a failed exchange every rank does this, so all agree)."""
        self._group = None
        self._restore_group = None
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
