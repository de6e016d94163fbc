"""The keywords of a DCP save, written once: :class:`SaveOptions` and the decorator that gives a
save entry point those keywords.

``tierpoint.dcp.save``, ``async_save_request`` and ``async_save`` take the same keywords
(``process_group``, ``thread_count``, ``storage_options``, ``planner``, ``coordinator_rank``,
``enable_cache``, ``metadata_cache``, ``staging_pool``, ``sync_files``, ``upload``,
``overwrite``; the async ones ``source_file`` too). Each is declared here once, with its default, as a field of the frozen dataclass
:class:`SaveOptions`; :func:`takes_save_options` wraps an entry point written as
``fn(..., *, <its own keywords>, options: SaveOptions)`` into one that users call with the
keywords, as before.

Call order: at import, ``@takes_save_options(...)`` builds the public signature (the function's
own parameters, then the option fields in field order); at each call the wrapper moves the option
keywords it was given into one :class:`SaveOptions` and calls the function with ``options=``.

Invariants:
- The public signature (``inspect.signature``, ``typing.get_type_hints``, ``help``) is the
  function's own parameters followed by the option fields it accepts, keyword-only, with their
  defaults and annotations; the option fields it does not accept (``without``) are refused, and so
  is any other unknown keyword, with Python's own ``TypeError``.
- Internal: not exported by :mod:`tierpoint.dcp`; callers never see :class:`SaveOptions`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from torch.distributed.checkpoint.planner import SavePlanner

from ..errors import CheckpointingError, check_flag
from ..staging import SourceFile
from ..storage import DEFAULT_UPLOAD, UploadOptions
from .staging_pool import StagingPool
from .state_dict_saver import CheckpointMetadataCache

R = TypeVar("R")
KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """The keywords of a save; see :func:`tierpoint.dcp.save` for what each one does."""

    process_group: Any = None
    thread_count: int = 2
    storage_options: Mapping[str, Any] | None = None
    planner: SavePlanner | None = None
    coordinator_rank: int = 0
    enable_cache: bool = True
    metadata_cache: CheckpointMetadataCache | None = None
    staging_pool: StagingPool | None = None
    sync_files: bool = True
    upload: UploadOptions = DEFAULT_UPLOAD
    overwrite: bool = False
    source_file: SourceFile | None = None

    def __post_init__(self) -> None:
        """Refuse a wrong keyword before the save touches anything (``overwrite="no"`` would
        un-commit a checkpoint, ``sync_files=None`` skip every fsync)."""
        for name in ("enable_cache", "sync_files", "overwrite"):
            check_flag(name, getattr(self, name))
        rank = self.coordinator_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise CheckpointingError(f"coordinator_rank must be an int >= 0, got {rank!r}")
        cache = self.metadata_cache
        if cache is not None and not isinstance(cache, CheckpointMetadataCache):
            raise CheckpointingError(
                f"metadata_cache must be a CheckpointMetadataCache or None, got {type(cache).__name__}"
            )


_FIELDS = dataclasses.fields(SaveOptions)


def takes_save_options(
    *, without: tuple[str, ...] = ()
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorate ``fn(..., *, options: SaveOptions)``: the result takes every option field but
    those named in ``without`` as a keyword (after ``fn``'s own parameters) and calls ``fn`` with
    them gathered into ``options``."""
    names = {f.name for f in _FIELDS}
    unknown = set(without) - names
    if unknown:
        raise ValueError(f"no save options {sorted(unknown)}")
    fields = [f for f in _FIELDS if f.name not in without]

    def decorate(fn: Callable[..., R]) -> Callable[..., R]:
        own = inspect.signature(fn)
        kept = [p for p in own.parameters.values() if p.name != "options"]
        added = [
            inspect.Parameter(f.name, KEYWORD_ONLY, default=f.default, annotation=f.type)
            for f in fields
        ]
        accepted = frozenset(f.name for f in fields)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> R:
            if "options" in kwargs:
                raise TypeError(f"{fn.__name__}() got an unexpected keyword argument 'options'")
            given = {k: kwargs.pop(k) for k in accepted & kwargs.keys()}
            return fn(*args, options=SaveOptions(**given), **kwargs)

        wrapper.__signature__ = own.replace(parameters=kept + added)  # type: ignore[attr-defined]
        hints = typing.get_type_hints(SaveOptions)
        wrapper.__annotations__ = {
            **{p.name: fn.__annotations__[p.name] for p in kept if p.name in fn.__annotations__},
            **{f.name: hints[f.name] for f in fields},
            **{k: v for k, v in fn.__annotations__.items() if k == "return"},
        }
        return wrapper

    return decorate
