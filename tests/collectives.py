"""Counting torch.distributed collectives in multi-rank tests (how much a step coordinates)."""

from __future__ import annotations

import torch.distributed as dist


class CountCollectives:
    """Counts calls of torch.distributed collectives while active (monkeypatched module functions)."""

    NAMES = (
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "gather",
        "gather_object",
        "scatter_object_list",
        "broadcast",
    )

    def __enter__(self) -> dict[str, int]:
        self.counts = dict.fromkeys(self.NAMES, 0)
        self.saved = {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self.saved.items():
            setattr(dist, name, self._counting(name, fn))
        return self.counts

    def _counting(self, name: str, fn):
        def wrapper(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)
