"""The ``.metadata`` file of a DCP step directory: the commit point of a save.

Call order (inside :class:`~tierpoint.dcp.writer.Writer`): at set-up, before this rank makes its
marker, :func:`refuse_complete` refuses to save over a complete checkpoint (unless ``overwrite``);
at the commit, the coordinator calls :func:`publish_rows` (or, in torch's own flow,
:func:`publish_results`) once every rank's data is durable.

Invariants:
- A complete directory (``.metadata`` and no unfinished marker) is never written into unless
  ``overwrite``; one whose save was killed between its commit and the removal of its markers is not
  complete and is saved into again (with a warning on the coordinator).
- ``.metadata`` is torch's pickled ``Metadata`` (:mod:`tierpoint.dcp.metadata_bytes`) followed
  by its checksum seal (:mod:`tierpoint.dcp.metadata_seal`), written atomically (tmp + fsync +
  rename, or one PUT on object stores); before it, the files of an earlier save that it does not
  name are removed (the markers still keep the step from counting as complete meanwhile), unless
  the writing job cleared them before (tierpoint's saves to object stores: ``tidy=False``), and a
  save whose own files are gone by then (a later save into the step took it over) is not
  committed.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from .. import storage
from ..errors import CheckpointingError
from . import directory
from .file_plan import add_token
from .metadata_bytes import Rows, file_names, metadata_bytes, pickled
from .metadata_seal import sealed
from .names import METADATA_NAME, markers_in

logger = logging.getLogger("tierpoint")


def refuse_complete(
    path: str,
    is_coordinator: bool,
    storage_options: Mapping[str, Any],
    upload: storage.UploadOptions,
) -> bool:
    """Raise if ``path`` holds a complete checkpoint; a committed one whose markers are left (a
    save killed after its commit) is not complete: saved into again. Returns whether ``path``
    holds a ``.metadata`` (the caller need not remove what is not there)."""
    if storage.is_local(path):  # a stat; the directory (perhaps large, shared) listed only then
        found = storage.exists(storage.join(path, METADATA_NAME), storage_options, upload)
        names = storage.listdir(path, storage_options, upload) if found else []
    else:  # one request, where s3fs's check of a missing key makes two
        names = storage.listdir(path, storage_options, upload)
        found = METADATA_NAME in names
    if not found:
        return False
    # Markers next to a .metadata: a save killed after its commit and before its clean-up
    # (get_latest_complete_checkpoint never offers it). No rank of this save has made its
    # marker yet (each checks first, and none passes when the directory is complete).
    stale = markers_in(names)
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
    return True


def publish_rows(
    path: str,
    metadata: Metadata,
    rows: Rows,
    token: str,
    storage_meta: StorageMeta | None,
    storage_options: Mapping[str, Any],
    upload: storage.UploadOptions,
    tidy: bool = True,
) -> list[str] | None:
    """:func:`publish_metadata` for every rank's write results ``rows`` (tierpoint's commit; see
    :mod:`tierpoint.dcp.write_results`), the data files named for the save ``token``; without
    ``tidy`` (the writing job cleared the directory already) nothing is listed or removed."""
    data = metadata_bytes(metadata, rows, token, storage_meta)
    referenced = {add_token(name, token) for name in file_names(rows)} if tidy else None
    return publish_metadata(path, data, referenced, storage_options, upload)


def publish_results(
    path: str,
    metadata: Metadata,
    results: list[list[WriteResult]],
    storage_meta: StorageMeta | None,
    storage_options: Mapping[str, Any],
    upload: storage.UploadOptions,
) -> list[str] | None:
    """:func:`publish_metadata` for torch's ``WriteResult`` objects (torch's own save flow)."""
    storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
    names = [getattr(info, "relative_path", None) for info in storage_data.values()]
    referenced = [n for n in names if isinstance(n, str)]
    data = pickled(metadata, storage_data, storage_meta)
    known = len(referenced) == len(names)
    return publish_metadata(path, data, referenced if known else None, storage_options, upload)


def publish_metadata(
    path: str,
    data: bytes,
    referenced: Collection[str] | None,
    storage_options: Mapping[str, Any],
    upload: storage.UploadOptions,
) -> list[str] | None:
    """Remove the files of an earlier save into ``path`` that are not ``referenced`` (``None``: the
    names are not known, nothing is listed or removed), refusing the commit if ``referenced`` files
    are gone (see :func:`~tierpoint.dcp.directory.remove_unreferenced_files`); then write
    ``.metadata`` (atomically): ``data`` (:mod:`tierpoint.dcp.metadata_bytes`) and its seal
    (:mod:`tierpoint.dcp.metadata_seal`). Returns the unfinished markers the listing saw, or None."""
    markers = None
    if referenced is not None:  # (the markers keep the step from counting as complete meanwhile)
        markers = directory.remove_unreferenced_files(path, referenced, storage_options, upload)
    storage.publish(
        storage.join(path, METADATA_NAME),
        sealed(data),
        storage_options=storage_options,
        upload=upload,
    )
    return markers
