"""The ``.metadata`` file of a DCP step directory: the commit point of a save.

Call order (inside :class:`~tierpoint.dcp.writer.Writer`): at set-up, before this rank makes its
marker, :func:`refuse_complete` refuses to save over a complete checkpoint (unless ``overwrite``);
at the commit, the coordinator calls :func:`publish_metadata` once every rank's data is durable.

Invariants:
- A complete directory (``.metadata`` and no unfinished marker) is never written into unless
  ``overwrite``; one whose save was killed between its commit and the removal of its markers is not
  complete and is saved into again (with a warning on the coordinator).
- ``.metadata`` is torch's pickled ``Metadata`` (torch's own classes only, the version torch's own
  writer records, NVRx's ``all_local_plans`` kept), written atomically (tmp + fsync + rename, or one
  PUT on object stores); after it, the files of an earlier save that it does not name are removed
  (the markers still keep the step from counting as complete meanwhile).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from .. import storage
from ..errors import CheckpointingError
from . import directory
from .names import METADATA_NAME

try:  # the version string torch's own writer records
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # pragma: no cover - older torch
    CURRENT_DCP_VERSION = None

logger = logging.getLogger("tierpoint")


def refuse_complete(
    path: str,
    is_coordinator: bool,
    storage_options: Mapping[str, Any],
    upload: storage.UploadOptions,
) -> None:
    """Raise if ``path`` holds a complete checkpoint; a committed one whose markers are left (a
    save killed after its commit) is not complete: saved into again."""
    if not storage.exists(storage.join(path, METADATA_NAME), storage_options, upload):
        return
    # Markers next to a .metadata: a save killed after its commit and before its clean-up
    # (get_latest_complete_checkpoint never offers it). No rank of this save has made its
    # marker yet (each checks first, and none passes when the directory is complete).
    stale = directory.visible_markers(path, storage_options, upload)
    if not stale:
        raise CheckpointingError(
            f"Checkpoint already exists and overwrite=False: {path} already holds "
            "a complete checkpoint: save to a new step directory, or pass overwrite=True "
            "(a crash during the new save would then leave none there)"
        )
    if is_coordinator:
        logger.warning(
            "%s was committed by a save that never finished (%s left): it does not count "
            "as complete; saving into it again",
            path,
            ", ".join(stale),
        )


def publish_metadata(
    path: str,
    metadata: Metadata,
    results: list[list[WriteResult]],
    storage_meta: StorageMeta | None,
    storage_options: Mapping[str, Any],
    upload: storage.UploadOptions,
) -> None:
    """Write ``.metadata`` (atomically) for ``results``; then remove the files of an earlier save
    into ``path`` that it does not refer to."""
    storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
    md = dataclasses.replace(metadata, storage_data=storage_data, storage_meta=storage_meta)
    if CURRENT_DCP_VERSION is not None:
        md.version = CURRENT_DCP_VERSION
    if hasattr(metadata, "all_local_plans"):  # NVRx's attribute (see tierpoint.dcp.planning)
        md.all_local_plans = metadata.all_local_plans  # type: ignore[attr-defined]
    storage.publish(
        storage.join(path, METADATA_NAME),
        pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL),
        storage_options=storage_options,
        upload=upload,
    )
    referenced = [getattr(info, "relative_path", None) for info in storage_data.values()]
    if all(isinstance(name, str) for name in referenced):
        # Files of an earlier save into this directory that this one did not replace (the
        # markers still keep the step from counting as complete meanwhile).
        directory.remove_unreferenced_files(path, referenced, storage_options, upload)
