"""What ``ls`` and ``verify`` check of an OLMo-core step (``step<N>/``, written by
:class:`tierpoint.Checkpointer`) besides its DCP checkpoint ``model_and_optim/``: its
``.metadata.json`` and its trainer-state files ``train/rank<r>.safetensors`` (tierpoint's part
files) or ``train/rank<r>.pt`` (OLMo-core's pickles).

Call order: ``ls`` calls :func:`step_status` once the DCP checkpoint's cheap checks passed;
``verify`` calls :func:`step_checks` for a step (``.metadata.json`` and the files it implies, then
one check per trainer-state file) and :func:`train_dir_checks` for a ``train/`` directory; each
check is run later by the command (:func:`verify_trainer_file` reads a file completely).

Invariants:
- A step is ``complete`` for ``ls`` only when the Checkpointer's own discovery rule
  (:func:`tierpoint.checkpointer.discovery.finished_metadata`) takes it: ``ls`` and
  ``Checkpointer.latest_checkpoint`` agree on what is restorable, except that ``ls`` also calls a
  step ``corrupt`` whose trainer-state files are not all there.
- The trainer-state files a step needs: one per rank of the world size its ``.metadata.json``
  records (rank 0's when it records none, as OLMo-core's does), in either format.
- A trainer-state part file verifies only when every checksum matches and it records the save
  ``.metadata.json`` records and the rank its name says (what the Checkpointer's loader checks:
  :func:`tierpoint.checkpointer.trainer_state.check_binding`; the rank alone where
  ``.metadata.json`` cannot be read, which its own check reports); a pickle is loaded with
  ``torch.load(weights_only=True)`` and reported unverified (it has no checksums).
- Only listings and ``.metadata.json`` are read by :func:`step_status`; nothing is written.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CheckpointingError
from .files import load_pt

_TRAINER_FILE = re.compile(r"^rank([0-9]+)\.(safetensors|pt)$")

Check = tuple[str, str, Callable[[], tuple[str, str]]]
"""One check for ``verify``: its target, its kind and what runs it (returns status and detail)."""


def trainer_files(train_dir: str, options: Mapping[str, Any]) -> dict[str, int]:
    """Each trainer-state file directly under ``train_dir`` (its URL) and its rank."""
    from .. import storage

    return {
        storage.join(train_dir, n): int(m.group(1))
        for n in storage.listdir(train_dir, options)
        if (m := _TRAINER_FILE.match(n))
    }


def missing_trainer_files(step_dir: str, meta: Any, present: Mapping[str, int]) -> list[str]:
    """The trainer-state files ``step_dir`` needs (see the module's invariants) but lacks, each
    named as its writer (tierpoint's Checkpointer or OLMo-core's, as ``meta`` says) names it."""
    from ..checkpointer.metadata import TIERPOINT_TRAINER_STATE
    from ..checkpointer.trainer_state import state_files

    world = meta.world_size if meta is not None and meta.world_size else 1
    ours = meta is None or meta.trainer_state == TIERPOINT_TRAINER_STATE
    ranks = set(present.values())
    return [state_files(step_dir, r)[0 if ours else 1] for r in range(world) if r not in ranks]


def step_status(step_dir: str, options: Mapping[str, Any]) -> tuple[str, str, int | None]:
    """``ls``'s status and detail of an OLMo-core step whose DCP checkpoint looks complete, and
    the world size its ``.metadata.json`` records (None: unknown). ``.metadata.json`` is judged by
    the Checkpointer's own rule (:func:`~tierpoint.checkpointer.discovery.finished_metadata`)."""
    from .. import storage
    from ..checkpointer import discovery
    from ..checkpointer.trainer_state import TRAIN_DIR

    try:
        meta = discovery.finished_metadata(step_dir, options)
    except CheckpointingError as e:  # the Checkpointer skips it: damaged, or a file missing
        return "corrupt", f"{e} (the Checkpointer skips it)", _recorded_world(step_dir, options)
    world = meta.world_size if meta is not None else None
    present = trainer_files(storage.join(step_dir, TRAIN_DIR), options)
    missing = missing_trainer_files(step_dir, meta, present)
    if missing:
        names = ", ".join(f"{TRAIN_DIR}/{storage.basename(p)}" for p in missing)
        return "corrupt", f"trainer state missing: {names} ({world} ranks saved)", world
    return "complete", "", world


def _recorded_world(step_dir: str, options: Mapping[str, Any]) -> int | None:
    """The world size ``.metadata.json`` records, where it can be read."""
    from ..checkpointer.metadata import read_metadata

    try:
        return read_metadata(step_dir, options).world_size
    except (CheckpointingError, OSError):
        return None


def step_checks(step_dir: str, options: Mapping[str, Any]) -> list[Check]:
    """``verify``'s checks of an OLMo-core step besides ``model_and_optim/``: its
    ``.metadata.json`` (there and parses), each trainer-state file it implies but lacks (fails),
    each trainer-state file there."""
    from .. import storage
    from ..checkpointer.metadata import METADATA_FNAME, read_metadata
    from ..checkpointer.trainer_state import TRAIN_DIR

    meta_path = storage.join(step_dir, METADATA_FNAME)
    meta, problem = None, None
    try:
        if not storage.exists(meta_path, options):
            raise CheckpointingError(
                f"{meta_path}: missing: the Checkpointer's save never finished"
            )
        meta = read_metadata(step_dir, options)
    except CheckpointingError as e:  # reported by its check; the other checks still run
        problem = e
    world = meta.world_size if meta is not None and meta.world_size else None

    def check_metadata() -> tuple[str, str]:
        if problem is not None:
            raise problem
        return "ok", f"parses; records {world or 'no'} ranks' trainer state"

    checks: list[Check] = [(meta_path, "metadata", check_metadata)]
    present = trainer_files(storage.join(step_dir, TRAIN_DIR), options)
    why = f"missing ({METADATA_FNAME} records {world} ranks)" if world else "missing"
    for path in missing_trainer_files(step_dir, meta, present):
        checks.append((path, "trainer", lambda: ("FAIL", why)))
    return checks + _file_checks(step_dir, present, options, meta, problem is None)


def train_dir_checks(train_dir: str, options: Mapping[str, Any]) -> list[Check]:
    """``verify``'s checks of a ``train/`` directory: each trainer-state file in it (none there:
    a :class:`~tierpoint.cli.output.CommandError`)."""
    from .. import storage
    from .output import CommandError

    present = trainer_files(train_dir, options)
    if not present:
        raise CommandError(f"{train_dir}: no trainer-state files (rank<r>.safetensors or .pt)")
    if storage.is_local(train_dir):
        step_dir = os.path.dirname(os.path.abspath(storage.local_path(train_dir)))
    else:
        step_dir = train_dir.rstrip("/").rsplit("/", 1)[0]
    from ..checkpointer.metadata import read_metadata

    try:
        meta, known = read_metadata(step_dir, options), True
    except CheckpointingError:  # missing or damaged: only the rank each file records is checked
        meta, known = None, False
    return _file_checks(step_dir, present, options, meta, known)


def is_train_dir(names: list[str]) -> bool:
    """Whether a directory holding ``names`` is a step's ``train/`` directory."""
    return any(_TRAINER_FILE.match(n) for n in names)


def _file_checks(
    step_dir: str, present: Mapping[str, int], options: Mapping[str, Any], meta: Any, known: bool
) -> list[Check]:
    """One check per trainer-state file; ``meta``: the step's ``.metadata.json`` (``known``: it
    could be read, so the save it records is checked too)."""
    from .. import storage
    from ..checkpointer.trainer_state import binding

    step, save_id = storage.basename(step_dir), meta.save_id if meta is not None else None
    return [
        (
            path,
            "trainer",
            lambda p=path, r=rank: verify_trainer_file(
                p, step, binding(step_dir, r, save_id) if known else {"rank": r}, options
            ),
        )
        for path, rank in sorted(present.items(), key=lambda item: (item[1], item[0]))
    ]


def verify_trainer_file(
    url: str, step: str, expected: Mapping[str, Any], options: Mapping[str, Any]
) -> tuple[str, str]:
    """Read a trainer-state file completely: a part file's every checksum and the save and rank it
    records (``expected``: :func:`~tierpoint.checkpointer.trainer_state.binding`), or a pickle
    through ``torch.load(weights_only=True)``."""
    from .. import fileformat
    from ..checkpointer.trainer_state import check_binding

    if url.endswith(".pt"):
        with _local_copy(url, options) as path:
            load_pt(path)
        return "unverified", "OLMo-core's pickled trainer state: loads, has no checksums"
    with _local_copy(url, options) as path:
        header = fileformat.verify(path)
    check_binding(url, header.extra, expected)
    detail = f"{len(header.records)} tensors, {header.file_size} bytes, every checksum matches"
    return "ok", f"trainer state of {step} rank {expected['rank']}: {detail}"


class _local_copy:
    """A local path to ``url``'s bytes: the file itself, or a temporary copy of an object."""

    def __init__(self, url: str, options: Mapping[str, Any]) -> None:
        self.url, self.options, self.tmp = url, options, None

    def __enter__(self) -> str:
        from .. import storage

        if storage.is_local(self.url):
            return storage.local_path(self.url)
        fd, self.tmp = tempfile.mkstemp(prefix="tierpoint-verify-", suffix=".safetensors")
        with os.fdopen(fd, "wb") as f:
            f.write(storage.read_bytes(self.url, self.options))
        return self.tmp

    def __exit__(self, *exc: object) -> None:
        if self.tmp is not None:
            os.unlink(self.tmp)
