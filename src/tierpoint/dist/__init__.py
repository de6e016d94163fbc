"""Ranks, nodes, tierpoint's own coordination group, bounded collectives, and error agreement.

One module per idea, lowest floor first (each imports only the ones above it in this list):
:mod:`.timeouts` (how long a wait may take), :mod:`.ranks` (rank, world size, single-process
fallback), :mod:`.group` (the coordination group; collectives bounded, silent ranks named),
:mod:`.messages` (JSON collectives with their step header), :mod:`.nodes` (node identity, layout,
node groups, :func:`gather_by_node`), :mod:`.agreement` (every rank raises the same error). This
package re-exports their names: ``tierpoint.dist.<name>`` is the way to use them.

Call order: anything collective goes through :func:`coordination_group` (created lazily, once per
default process group, on every rank at the same call site), then :func:`reduce_ints` /
:func:`agree` (the common case: O(1) bytes per rank) or :func:`all_gather_json` /
:func:`broadcast_json` (details, plans). Each of them except the broadcast starts with one all-reduce
of a few integers that carries a hash of the step it serves, so ranks at different steps get one
clear error, and agreements gather texts only when some rank failed. With ``torch.distributed`` not
initialised everything works as a single process (rank 0 of 1) and no collective runs.

Invariants:
- tierpoint never issues collectives on the training group: the coordination group is a separate gloo
  group (also when the default group is NCCL), so background saves cannot deadlock training.
- Every collective is bounded by the group's timeout; a timeout or a vanished peer becomes a
  :class:`CheckpointingError` (:class:`CoordinationTimeoutError` for timeouts), never a hang.
- :func:`agree` makes every rank raise the same :class:`CheckpointingError`, naming each failing rank
  and its message, when any rank failed (a subclass such as :class:`CorruptCheckpointError` when all
  failing ranks raised that tierpoint class).
- Messages between ranks are JSON, never pickle.
"""

from __future__ import annotations

from .agreement import _MAX_MESSAGE as _MAX_MESSAGE
from .agreement import (
    Agreement,
    agree,
    agree_on_settings,
    failure_status,
    raise_failures,
    raise_if_any_failed,
)
from .group import _SILENT_GRACE_S as _SILENT_GRACE_S
from .group import _broken as _broken
from .group import _first_line as _first_line
from .group import _groups as _groups
from .group import (
    coordination_group,
    destroy_group,
    drop_at_exit,
    run_collective,
    silent_ranks,
    step_kind,
)
from .messages import _HEADER_VALUES as _HEADER_VALUES
from .messages import (
    all_gather_json,
    barrier,
    broadcast_json,
    gather_json,
    header,
    reduce_ints,
)
from .nodes import (
    NodeGroups,
    NodeLayout,
    gather_by_node,
    known_node_layout,
    node_groups,
    node_id,
    node_layout,
)
from .nodes import _layouts as _layouts
from .nodes import _node_groups as _node_groups
from .ranks import (
    get_rank,
    get_world_size,
    is_distributed,
    log_progress,
    refuse_uninitialised_launch,
)
from .timeouts import DEFAULT_TIMEOUT_S, check_timeout, default_timeout, timeout_or

# The names these helpers had while they lived in one module.
_run_collective = run_collective
_silent_ranks = silent_ranks
_step = step_kind
_header = header

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "NodeGroups",
    "NodeLayout",
    "Agreement",
    "agree",
    "agree_on_settings",
    "all_gather_json",
    "barrier",
    "broadcast_json",
    "check_timeout",
    "coordination_group",
    "destroy_group",
    "drop_at_exit",
    "default_timeout",
    "failure_status",
    "gather_by_node",
    "gather_json",
    "get_rank",
    "get_world_size",
    "header",
    "is_distributed",
    "known_node_layout",
    "log_progress",
    "node_groups",
    "node_id",
    "node_layout",
    "raise_failures",
    "raise_if_any_failed",
    "reduce_ints",
    "refuse_uninitialised_launch",
    "run_collective",
    "silent_ranks",
    "step_kind",
    "timeout_or",
]
