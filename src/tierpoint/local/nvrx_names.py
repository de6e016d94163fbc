"""NVRx's helper methods on the local manager that scripts call: ids and file names of parts.

A mixin of :class:`~tierpoint.local.LocalCheckpointManager` (it uses the manager's ``rank``,
``session_id``, ``local_ckpt_dir`` and ``_latest``). The names are NVRx's; the files they name are
tierpoint's: ``iter_<7 digits>_<rank>_local.safetensors`` (not ``.pt``), and an unfinished file is
that name plus ``.dirty``. No collective; nothing is written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointingError
from . import naming
from .naming import CkptID


class NVRxFileNames:
    rank: int
    session_id: str
    local_ckpt_dir: Path
    _latest: int | None

    @property
    def latest_iteration(self) -> int:
        """The latest complete iteration as last found (NVRx's attribute), -1 when not known."""
        return naming.NO_CHECKPOINT if self._latest is None else self._latest

    def _ckpt_id(self, iteration: int) -> CkptID:
        """This rank's id of ``iteration``'s checkpoint."""
        return CkptID(naming.check_iteration(iteration), self.rank, self.session_id)

    def _filename_from_template(
        self, iteration: int | str, rank: int | str, extra_suffix: str = ""
    ) -> str:
        """The part file name for ``iteration`` and ``rank``; either may be a glob or regex piece
        (a string), as NVRx scripts pass them. ``extra_suffix=".dirty"`` names the unfinished file."""
        if isinstance(iteration, str) and iteration.isdigit():
            if len(iteration) < 7:
                raise CheckpointingError(
                    f"an iteration string has at least 7 digits: {iteration!r}"
                )
        elif not isinstance(iteration, str):
            iteration = f"{naming.check_iteration(iteration):07d}"
        if extra_suffix == naming.DIRTY_SUFFIX:
            return f"iter_{iteration}_{rank}_local{naming.EXTENSION}{naming.DIRTY_SUFFIX}"
        return f"iter_{iteration}_{rank}_local{extra_suffix}{naming.EXTENSION}"

    def _local_ckpt_path_from_id(self, ckpt_id: Any, is_dirty: bool = False) -> Path:
        """Where the part with ``ckpt_id`` (iteration, origin rank, session) lives on this rank."""
        iteration, rank, session_id = ckpt_id
        if session_id != self.session_id:
            raise CheckpointingError(
                f"checkpoint id {tuple(ckpt_id)} is of session {session_id!r}, this manager's is "
                f"{self.session_id!r}"
            )
        suffix = naming.DIRTY_SUFFIX if is_dirty else ""
        return self.local_ckpt_dir / self._filename_from_template(iteration, rank, suffix)

    def _filename_to_id(self, filename: str | os.PathLike) -> CkptID:
        """The id of a part file name (``CheckpointingError`` for any other name)."""
        parsed = naming.parse_part_name(os.path.basename(filename))
        if parsed is None:
            raise CheckpointingError(f"not a local part file name: {os.fspath(filename)!r}")
        return CkptID(parsed[0], parsed[1], self.session_id)

    def _my_ckpt_ids(self) -> list[CkptID]:
        """The ids of the committed parts (own and replicas) in this rank's directory."""
        if not self.local_ckpt_dir.is_dir():
            return []
        names = sorted(os.listdir(self.local_ckpt_dir))
        return [self._filename_to_id(n) for n in names if naming.parse_part_name(n) is not None]
