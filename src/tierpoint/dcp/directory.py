"""A step directory's life across saves: its location, this rank's unfinished marker, the claim of an
async save in flight, and the removal of what an earlier save into it left.

Call order (driven by :class:`~tierpoint.dcp.writer.Writer`): :func:`absolute` fixes the location
once; at set-up :func:`claim` (``check_only``) refuses a directory an async save of this process is
writing, :func:`make_marker` creates the directory and ``.unfinished-<rank>``, and on local paths
:func:`earlier_save_files` lists what an earlier save left, and :func:`flashpoint_markers` the
unfinished markers ML Flashpoint left next to a ``step-<N>_ckpt`` directory (both removed by the
writer once every rank agreed, while this save's own markers keep the step unfinished); an async save then holds its :func:`claim` until :func:`release` (finalized or discarded);
at the commit, before ``.metadata`` is written, :func:`remove_unreferenced_files` removes the data
files it will not name (refusing the commit when this save's own are gone) and returns the markers
its listing saw, which the coordinator removes (one listing, one bulk
removal on an object store; :func:`visible_markers` lists them where that listing was not made).
In tierpoint's own flow on an object store the coordinator's writing job does that instead, in the
worker, before any data of its own is written (:func:`clear_for_new_save`): the commit then lists
nothing, and each rank removes its own marker.

Invariants:
- At most one async save of this process is in flight per directory (``_claimed``, under
  ``_claims_lock``; keyed by the real path, or the URL without its trailing slash).
- A data file is ``__<rank>_<k>.<token>.distcp`` or a checksum manifest
  (:func:`is_data_file`); only such files and ``.metadata`` count as a save's: anything else in
  the directory (a symbolic link, a user's file) is never removed.
- Removing an earlier save's unreferenced files never fails a save: a failure is logged.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Collection, Mapping
from typing import Any

from .. import dist as tpdist
from .. import storage
from ..errors import CheckpointingError
from .checksums import is_manifest, manifest_name
from .file_plan import SUFFIX
from .names import (
    METADATA_NAME,
    marker_name,
    marker_rank,
    markers_in,
    sibling_markers_of,
    step_dir_of,
    step_of,
)

logger = logging.getLogger("tierpoint")

_claimed: set[str] = set()
"""Step directories an async save of this process writes into (see :func:`claim`)."""
_claims_lock = threading.Lock()


def absolute(path: str) -> str:
    """A local path made absolute now: every step of a save (set-up, snapshot, the worker's writing,
    the commit) then names the same directory, whatever the working directory of the process
    running it (the worker keeps its own; the caller may change its own meanwhile)."""
    if not storage.is_local(path):
        return path
    absolute_path = os.path.abspath(storage.local_path(path))
    return f"file://{absolute_path}" if path.startswith("file://") else absolute_path


def claim(path: str, *, check_only: bool = False) -> str | None:
    """Refuse if an async save into ``path`` is in flight in this process; else (unless
    ``check_only``) mark one as in flight there and return its key for :func:`release`."""
    key = os.path.realpath(path) if storage.is_local(path) else path.rstrip("/")
    with _claims_lock:
        if key in _claimed:
            raise CheckpointingError(
                f"{path}: an async save into it is still in flight in this process; "
                "finalize it first (AsyncCallsQueue.maybe_finalize_async_calls(blocking=True), "
                "or the result of async_save)"
            )
        if check_only:
            return None
        _claimed.add(key)
        return key


def release(key: str | None) -> None:
    """End the claim ``key`` (from :func:`claim`; ``None``: nothing to end)."""
    if key is not None:
        with _claims_lock:
            _claimed.discard(key)


def make_marker(
    path: str,
    rank: int,
    storage_options: Mapping[str, Any],
    upload: storage.UploadOptions = storage.DEFAULT_UPLOAD,
) -> None:
    """Create the step directory and rank ``rank``'s marker in it. Another rank's clean-up after a
    failed save removes the directory once it is empty, so a save that follows at once may find it
    gone between the two steps: then both are done again."""
    for attempt in range(3):
        storage.makedirs(path, storage_options)
        try:
            marker = storage.join(path, marker_name(rank))
            storage.touch(marker, storage_options=storage_options, upload=upload)
            return
        except CheckpointingError as e:
            if attempt == 2 or not isinstance(e.__cause__, FileNotFoundError):
                raise


def remove_earlier_files(
    path: str,
    names: list[str],
    storage_options: Mapping[str, Any],
    upload: storage.UploadOptions,
    flashpoint: list[str] | None = None,
) -> None:
    """Remove the files :func:`earlier_save_files` listed, and the ``flashpoint`` markers
    :func:`flashpoint_markers` listed (only while no rank of the new save can have written yet:
    its own markers keep the step unfinished)."""
    storage.remove_files(path, names, storage_options=storage_options, upload=upload)
    if names:
        logger.info("%s: removed %d file(s) of an earlier save", path, len(names))
    if flashpoint:
        parent = os.path.dirname(os.path.normpath(storage.local_path(path)))
        storage.remove_files(parent, flashpoint, upload=upload)
        logger.info("%s: removed ML Flashpoint's unfinished markers %s", path, flashpoint)


def clear_for_new_save(
    path: str,
    token: str,
    world_size: int,
    storage_options: Mapping[str, Any],
    upload: storage.UploadOptions,
) -> None:
    """The coordinator's writing job on an object store, once its marker is made (so that the step
    stays unfinished meanwhile): one listing, then the markers of ranks that this save of
    ``world_size`` ranks does not have go, and a ``.metadata`` that landed after the set-up removed
    the one it saw. A marker named for one of its ranks, even one an earlier save left, is that
    rank's to remove after the commit, so the commit needs no listing. Then, best effort, the data
    files and manifests of other saves go (names without ``token``, the save's agreed file token).
    Raises :class:`CheckpointingError` when the first removal fails: a stale marker left would keep
    the step from ever counting as complete."""
    names = storage.listdir(path, storage_options, upload)
    ranks = {n: marker_rank(n) for n in markers_in(names)}
    stale = [n for n, r in ranks.items() if r is None or r >= world_size]
    stale += [METADATA_NAME] if METADATA_NAME in names else []
    try:
        storage.remove_files(path, stale, storage_options=storage_options, upload=upload)
    except CheckpointingError as e:
        raise CheckpointingError(
            f"{path}: the unfinished markers or .metadata an earlier save left ({', '.join(stale)}) "
            f"could not be removed, so this save could never complete: {e}"
        ) from e
    earlier = [n for n in names if is_data_file(n) and f".{token}." not in n]
    try:
        remove_earlier_files(path, earlier, storage_options, upload)
    except CheckpointingError as e:
        _warn_left(path, earlier, e)


def visible_markers(
    path: str, storage_options: Mapping[str, Any], upload: storage.UploadOptions
) -> list[str]:
    """The unfinished markers in the step directory now, whoever made them."""
    return markers_in(storage.listdir(path, storage_options, upload))


def is_data_file(name: str) -> bool:
    """A save's data file or checksum manifest."""
    return (name.startswith("__") and name.endswith(SUFFIX)) or is_manifest(name)


def with_manifest(names: list[str]) -> list[str]:
    """A rank's data files of one save and the manifest of their checksums."""
    manifest = manifest_name(names[0]) if names else None
    return [*names, manifest] if manifest is not None else list(names)


def flashpoint_markers(directory: str) -> list[str]:
    """ML Flashpoint's unfinished markers of the local step directory ``directory``: regular files
    next to it named ``<its name>...unfinished`` (names in its parent; none for a ``step-<N>``)."""
    parent, name = os.path.split(os.path.normpath(directory))
    if step_of(name) is not None or step_dir_of(name) is None:
        return []  # not a step-<N>_ckpt directory: no listing of the base at every save
    try:
        with os.scandir(parent or ".") as entries:
            files = [e.name for e in entries if e.is_file(follow_symlinks=False)]
    except OSError as e:
        raise storage.failure("listing", parent, e) from e
    return sibling_markers_of(name, files)


def earlier_save_files(directory: str) -> list[str]:
    """The regular files named like a save's data files or ``.metadata`` in ``directory`` (a
    symbolic link or anything else there was not written by a save, and stays)."""
    try:
        with os.scandir(directory) as entries:
            return sorted(
                e.name
                for e in entries
                if (e.name == METADATA_NAME or is_data_file(e.name))
                and e.is_file(follow_symlinks=False)
            )
    except OSError as e:
        raise storage.failure("listing", directory, e) from e


def remove_unreferenced_files(
    path: str,
    referenced: Collection[str],
    storage_options: Mapping[str, Any],
    upload: storage.UploadOptions,
) -> list[str] | None:
    """Remove the data files in ``path`` that the new ``.metadata`` will not name (an earlier save
    into this directory left them: on an object store, or through torch's own save flow, nothing
    removed them before). Safe while an unfinished marker exists: the directory does not count as
    complete until the markers go. Nothing reads such files, so a failure to list or remove them
    is only logged. Returns the markers the listing showed (every marker of this save: none is
    removed before the commit is agreed), so that the coordinator removes them without listing
    again; None if the listing failed.

    Raises :class:`CheckpointingError`, removing nothing, when this rank's ``referenced`` files are
    missing: a later save into this step cleared them (a restarted job's, while this save's process was
    stopped), and committing would take its step over and remove its files."""
    named = set(referenced)
    keep = named | {manifest_name(name) for name in named}  # every rank's manifest
    earlier: list[str] = []
    try:
        names = storage.listdir(path, storage_options, upload)
    except CheckpointingError as e:
        _warn_left(path, earlier, e)
        return None
    own = f"__{tpdist.get_rank()}_"  # (on node-local paths the other ranks' are elsewhere)
    gone = sorted(n for n in named.difference(names) if n.startswith(own))
    if gone:
        raise CheckpointingError(
            f"{path}: not committed: files of this save are gone ({', '.join(gone[:3])}"
            f"{', ...' if len(gone) > 3 else ''}): another save into this step took it over"
        )
    earlier = [name for name in names if is_data_file(name) and name not in keep]
    try:
        storage.remove_files(path, earlier, storage_options=storage_options, upload=upload)
    except CheckpointingError as e:
        _warn_left(path, earlier, e)
    return markers_in(names)


def _warn_left(path: str, earlier: list[str], error: CheckpointingError) -> None:
    left = f" ({', '.join(earlier)})" if earlier else ""
    logger.warning("%s: data files of an earlier save left%s, unreferenced: %s", path, left, error)
