"""Persistent tier: torch DCP checkpoints (see the modules for each part).

``save`` / ``async_save`` / ``load`` / ``Writer`` / ``Reader`` take torch DCP's ``checkpoint_id=``;
ML Flashpoint's loader names come from :mod:`tierpoint.dcp.flashpoint`.
"""

from .flashpoint import (
    CheckpointContainerId,
    CheckpointObjectId,
    DefaultMLFlashpointCheckpointLoader,
    MLFlashpointCheckpointLoader,
)
from .latest import get_latest_complete_checkpoint
from .loading import SafeLoadPlanner, load
from .names import marker_name, step_path
from .reader import Reader, read_metadata
from .safe_pickle import CorruptDCPError, safe_loads
from .saving import SaveFuture, async_save, async_save_request, default_queue, save
from .staging_pool import StagingPool
from .state_dict_saver import (
    CheckpointMetadataCache,
    get_metadata_caching_status,
    init_checkpoint_metadata_cache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
    verify_global_md_reuse,
)
from .verify import CheckpointSummary, verify_checkpoint
from .warm_up import warm_up
from .writer import Writer

__all__ = [
    "CheckpointContainerId",
    "CheckpointMetadataCache",
    "CheckpointObjectId",
    "CheckpointSummary",
    "CorruptDCPError",
    "DefaultMLFlashpointCheckpointLoader",
    "MLFlashpointCheckpointLoader",
    "Reader",
    "SafeLoadPlanner",
    "SaveFuture",
    "StagingPool",
    "Writer",
    "async_save",
    "async_save_request",
    "default_queue",
    "get_latest_complete_checkpoint",
    "get_metadata_caching_status",
    "init_checkpoint_metadata_cache",
    "load",
    "marker_name",
    "read_metadata",
    "safe_loads",
    "save",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "step_path",
    "verify_checkpoint",
    "verify_global_md_reuse",
    "warm_up",
]
