"""The planning cache of DCP saves (NVRx names): what a save reuses from earlier saves.

Call order: a caller makes a :class:`CheckpointMetadataCache` (or uses the process-wide one,
:func:`default_metadata_cache`), optionally seeds it from a loaded checkpoint
(:meth:`~CheckpointMetadataCache.set_cached_global_metadata`, or
:func:`init_checkpoint_metadata_cache` for the process-wide one) and passes it to every save;
:mod:`tierpoint.dcp.planning` reads and records the plans, :mod:`tierpoint.dcp.commit` the write
results of the last commit.

Invariants:
- One cache serves one sequence of saves of one kind of state on one process group; all ranks use
  caching alike, so every rank's cache holds the same plans and the same last commit.
- The remembered write results are dropped on every rank alike after a failed finalize.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

logger = logging.getLogger("tierpoint")


class CheckpointMetadataCache:
    """What a save can reuse from earlier saves of the same state layout.

    Attributes (NVRx names): ``cached_central_plan`` (this rank's part of the global plan),
    ``cached_local_plan``, ``cached_global_metadata`` (coordinator only), ``validated_cache_reuse``
    (the last save reused the cached plan), ``validated_loaded_metadata_reuse`` (the last save reused
    plans loaded with :meth:`set_cached_global_metadata`), ``loaded_all_plans``.
    tierpoint adds ``planning_rounds``: how many saves ran the planning collectives.

    One cache serves one sequence of saves of one kind of state on one process group; all ranks
    must use caching alike.
    """

    def __init__(self) -> None:
        self.cached_central_plan: SavePlan | None = None
        self.cached_local_plan: SavePlan | None = None
        self.cached_global_metadata: Metadata | None = None
        self.validated_cache_reuse = False
        self.validated_loaded_metadata_reuse = False
        self.loaded_all_plans: list[SavePlan] | None = None
        self.planning_rounds = 0
        self.local_layout: Any = None
        """What ``cached_local_plan`` was made from (see :mod:`tierpoint.dcp.planning`)."""
        # The last commit of this cache's saves, the same on every rank: (digest of this rank's
        # write results, coordinator, world size); on the coordinator every rank's results too.
        self._committed: tuple[str, int, int] | None = None
        self._committed_results: list[list] | None = None

    def set_cached_global_metadata(self, cached_global_metadata: Metadata) -> None:
        """Seed the cache from a loaded checkpoint's metadata. If it carries ``all_local_plans``
        (every rank's local plan), the next save can skip planning when all ranks' plans match it."""
        self.cached_global_metadata = cached_global_metadata
        self.loaded_all_plans = getattr(cached_global_metadata, "all_local_plans", None)
        if self.loaded_all_plans is None:
            logger.debug("metadata has no all_local_plans: the first save will plan")

    def set_cache_metadata(
        self, central_plan: SavePlan, local_plan: SavePlan, global_md_verify_reuse: bool
    ) -> None:
        """Record the plans of the save just planned."""
        self.validated_loaded_metadata_reuse = global_md_verify_reuse
        self.validated_cache_reuse = (
            central_plan is self.cached_central_plan
        )  # reused, not replanned
        self.cached_central_plan = central_plan
        self.cached_local_plan = local_plan

    def prepare_save_state_dict_ret(
        self, rank: int, coordinator: int, save_state_dict_ret: tuple
    ) -> tuple:
        """Fill in (coordinator) or remember the global metadata of ``save_state_dict_ret``."""
        writer, metadata, dist_wrapper = save_state_dict_ret
        if rank != coordinator:
            return writer, None, dist_wrapper
        if metadata is None:
            metadata = self.cached_global_metadata
        else:
            self.cached_global_metadata = metadata
        return writer, metadata, dist_wrapper

    def get_cache_metadata(self) -> tuple:
        """``(cached_central_plan, cached_local_plan, validated_cache_reuse, loaded_all_plans)``."""
        return (
            self.cached_central_plan,
            self.cached_local_plan,
            self.validated_cache_reuse,
            self.loaded_all_plans,
        )

    def get_metadata_caching_status(self) -> tuple[bool, bool]:
        """``(validated_cache_reuse, validated_loaded_metadata_reuse)``."""
        return self.validated_cache_reuse, self.validated_loaded_metadata_reuse

    def forget_results(self) -> None:
        """Drop the remembered write results (after a failed finalize, every rank alike)."""
        self._committed = None
        self._committed_results = None


_checkpoint_metadata_cache: CheckpointMetadataCache | None = None


def init_checkpoint_metadata_cache(cached_global_metadata: Metadata) -> None:
    """Create the process-wide cache (if needed) and seed it with loaded metadata."""
    default_metadata_cache().set_cached_global_metadata(cached_global_metadata)


def default_metadata_cache() -> CheckpointMetadataCache:
    """The process-wide cache used when caching is enabled and no cache is given."""
    global _checkpoint_metadata_cache
    if _checkpoint_metadata_cache is None:
        _checkpoint_metadata_cache = CheckpointMetadataCache()
    return _checkpoint_metadata_cache


def get_metadata_caching_status() -> tuple[bool, bool] | None:
    """``(validated_cache_reuse, validated_loaded_metadata_reuse)`` of the process-wide cache, or
    ``None`` before it exists."""
    if _checkpoint_metadata_cache is None:
        return None
    return _checkpoint_metadata_cache.get_metadata_caching_status()
