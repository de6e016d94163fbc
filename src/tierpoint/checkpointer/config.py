"""``CheckpointerConfig``: OLMo-core's config dataclass for a :class:`Checkpointer`, with ``build()``.

Call order: ``CheckpointerConfig(work_dir=..., ...).build(process_group=None, **overrides)``.
Fields left ``None`` take the Checkpointer's defaults; ``overrides`` win over fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .checkpointer import Checkpointer


@dataclass
class CheckpointerConfig:
    """The fields of OLMo-core's ``CheckpointerConfig``; see :class:`Checkpointer` for each."""

    work_dir: str | None = None
    save_overwrite: bool | None = None
    pre_download: bool = False
    save_thread_count: int | None = None
    load_thread_count: int | None = None
    throttle_uploads: bool = False

    def build(self, process_group: Any = None, **kwargs: Any) -> Checkpointer:
        fields = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }
        kwargs = {**fields, **kwargs}
        work_dir = kwargs.pop("work_dir", None)
        if work_dir is None:
            raise ValueError("'work_dir' must be provided to build a Checkpointer")
        return Checkpointer(work_dir=work_dir, process_group=process_group, **kwargs)
