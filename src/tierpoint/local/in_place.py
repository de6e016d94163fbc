"""Async snapshots copied straight into the pages of a RAM tier's part files.

Call order: :class:`~tierpoint.local.saving.PartSaver` makes one :class:`InPlaceCopies` over its
store; an async save's snapshot calls :meth:`InPlaceCopies.copy` (the save is pending, its spare
taken), the save's abort calls :meth:`InPlaceCopies.abort`; :attr:`InPlaceCopies.busy` tells a sync
save that a snapshot is under way.

Invariants:
- The part's dirty file (a recycled spare, resized to plan) is mapped through the store's
  :class:`~tierpoint.peers.MappingCache`, which keeps the mapping from save to save and page-locks
  it once for a state with CUDA tensors, so that device copies land in the file at the pinned rate.
- A save aborted while its snapshot runs (the queue gave up on a stuck snapshot) loses nothing it
  should not: before the copy starts the snapshot sees the abort and copies nothing; once copying,
  its mapping is abandoned (never unpinned or unmapped under the copy, see
  :meth:`~tierpoint.peers.MappingCache.abandon`). Only the abort of that very iteration does this.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import torch

from .. import fileformat
from ..errors import CheckpointingError
from ..peers.mapping_cache import FileMapping
from ..pinning import copy_device
from ..snapshot_copy import Streams
from ..staging import copy_planned, planned_views
from ..tree import FlatState
from .store import PartStore

_VIEWS_KEPT = 4
"""Mappings whose views are kept (more than the part files a tier recycles in turn)."""


class InPlaceCopies:
    """The in-place snapshots of one rank's store (see the module docstring)."""

    def __init__(self, store: PartStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        # (iteration, the part file's mapping once mapped) while that snapshot runs
        self._copying: tuple[int, FileMapping | None] | None = None
        # per mapping (by its tensor's id): (that tensor, data start, layout key, the views)
        self._views: dict[int, tuple[torch.Tensor, int, tuple, list[torch.Tensor]]] = {}

    @property
    def busy(self) -> bool:
        """A snapshot is copying into a part file now."""
        return self._copying is not None

    def copy(
        self,
        flat: FlatState,
        plan: fileformat.PartPlan,
        iteration: int,
        spare: Path | None,
        hash_now: bool,
        after: Streams,
        image: torch.Tensor | None = None,
    ) -> list[str] | None:
        """Copy ``flat`` into the data section of ``iteration``'s dirty file (the spare's pages
        when there is one); ``hash_now``: also return the checksums; ``image``: ``flat``'s device
        tensors in one buffer (see :func:`tierpoint.staging.copy_planned`). The worker then
        seals the file."""
        with self._lock:
            self._copying = (iteration, None)  # an abort from here on stops the copy
        try:
            dirty = fileformat.dirty_name(self.store.part_path(iteration))
            size = fileformat.prepare_planned(dirty, plan, recycle=spare)
            entry = self.store.mappings.map(str(dirty), size, writable=True)
            device = copy_device(flat.tensors)
            pinned = device is not None and self.store.mappings.pin(entry, device)
            with self._lock:
                if self._copying != (iteration, None):
                    raise CheckpointingError(f"iteration {iteration} was aborted: nothing copied")
                self._copying = (iteration, entry)
            data = entry[1][plan.data_start() : plan.data_start() + plan.data_size]
            views = functools.partial(self._views_of, entry, plan, data)
            return copy_planned(flat, plan, data, pinned, hash_now, after, image, views)
        finally:
            with self._lock:
                if self._copying is not None and self._copying[0] == iteration:
                    self._copying = None

    def _views_of(
        self, entry: FileMapping, plan: fileformat.PartPlan, data: torch.Tensor
    ) -> list[torch.Tensor]:
        """``planned_views(data, plan)``, made once per mapping and layout (the recycled part files
        take turns: their mappings are kept from save to save). Held for the mapping's tensor
        itself, which the store's cache never hands out again once it unmapped it."""
        key = plan.layout_key
        if key is None:
            return planned_views(data, plan)
        memory, start = entry[1], plan.data_start()
        held = self._views.get(id(memory))
        if held is None or held[0] is not memory or held[1] != start or held[2] != key:
            held = (memory, start, key, planned_views(data, plan))
            self._views[id(memory)] = held
            while len(self._views) > _VIEWS_KEPT:
                del self._views[next(iter(self._views))]  # the oldest
        return held[3]

    def abort(self, iteration: int) -> None:
        """``iteration``'s save is aborted, its files about to be removed: a snapshot of it not
        copying yet stops; one copying keeps its mapping for good."""
        with self._lock:
            if self._copying is not None and self._copying[0] == iteration:
                if self._copying[1] is not None:
                    self.store.mappings.abandon([self._copying[1]])
                self._copying = None
