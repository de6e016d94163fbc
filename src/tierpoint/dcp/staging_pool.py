"""Staging buffers for async DCP saves, laid out as the files' tensor sections and reused across saves.

Call order: ``buf = pool.acquire(files)`` when a save snapshots (the buffer already holds every
record's head, tail and padding; only tensor data is copied in), the worker writes from it,
``pool.release(buf)`` once the save is finalized or aborted.

Invariants:
- A buffer is allocated once per layout (:attr:`RankFiles.key`) and reused by later saves of the
  same layout: host memory stays flat. A save never gets a buffer another unfinished save still uses
  (with several saves in flight, the pool holds one buffer per save in flight).
- A free buffer of another layout is freed when a new layout is acquired (the layout changed).
- The buffers are :class:`tierpoint.staging.StagingBuffer` (memfd shared memory), so the background
  worker maps them by file descriptor without copying.
"""

from __future__ import annotations

import threading

import torch

from ..staging import StagingBuffer
from .file_plan import RankFiles


class StagingPool:
    """Reusable staging buffers, keyed by file layout (see the module docstring)."""

    def __init__(self) -> None:
        self._free: list[tuple[tuple, StagingBuffer]] = []
        self._busy: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self.allocations = 0
        """How many buffers were ever allocated (tests check reuse with it)."""

    def acquire(self, files: RankFiles) -> StagingBuffer:
        with self._lock:
            for k, (key, buf) in enumerate(self._free):
                if key == files.key:
                    del self._free[k]
                    self._busy[buf.id] = key
                    return buf
            for _, stale in self._free:  # another layout: it is not coming back
                stale.close()
            self._free.clear()
        buf = StagingBuffer(files.staging_bytes)
        _write_templates(buf, files)
        with self._lock:
            self.allocations += 1
            self._busy[buf.id] = files.key
        return buf

    def release(self, buf: StagingBuffer) -> None:
        with self._lock:
            key = self._busy.pop(buf.id, None)
            if key is not None:
                self._free.append((key, buf))

    def close(self) -> None:
        with self._lock:
            for _, buf in self._free:
                buf.close()
            self._free.clear()

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return sum(b.nbytes for _, b in self._free)


def _write_templates(buf: StagingBuffer, files: RankFiles) -> None:
    """Put every record's head and tail in place (the memory starts zeroed: padding is done)."""
    for f in files.files:
        for slot in f.tensors:
            at = f.staging_base + slot.offset
            head, tail = slot.template.head, slot.template.tail
            buf.tensor[at : at + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
            if tail:
                at = f.staging_base + slot.offset + len(head) + slot.template.nbytes
                buf.tensor[at : at + len(tail)] = torch.frombuffer(
                    bytearray(tail), dtype=torch.uint8
                )
