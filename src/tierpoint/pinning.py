"""Page-locked (pinned) host memory with one owner: a range is registered with the CUDA runtime at
most once and unregistered before its memory is unmapped, on every path.

Call order: the owner of a mapping (:class:`tierpoint.staging.StagingBuffer`) holds a
:class:`PinnedRange`; when the memory is allocated for a state that has device tensors
(``device = copy_device(tensors)`` is not None) it calls ``pinned.register(address, nbytes, device)``
once, before any copy into it (the first save of a layout pays for it; later saves reuse the
pinned buffer; a DCP pool's spare is pinned in the background); ``pinned.release()`` runs before
the memory is unmapped:
from the owner's ``close`` and from its ``weakref.finalize`` (garbage collection, interpreter exit),
which also holds the mapping, so the mapping cannot go first.

Invariants:
- :func:`runtime` is the only way to the CUDA runtime's registration calls (tests put a fake in its
  place). It is None without CUDA: CPU-only runs never touch CUDA.
- A range is registered at most once and released at most once, by the runtime that registered it.
- A call that fails leaves no CUDA error pending (the runtime's last error is consumed at once, so
  torch never finds it later and blames an unrelated kernel). A registration that fails leaves the
  memory unpinned, with one WARNING; copies into it still work (synchronously), nothing raises.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Sequence
from typing import Protocol

import torch

logger = logging.getLogger("tierpoint")

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not just the current one


class Runtime(Protocol):
    """What pinning needs from a device runtime (CUDA's, or a test's fake)."""

    def copy_device(self, tensors: Sequence[torch.Tensor]) -> int | None:
        """The device whose copies to host pinning speeds up for ``tensors`` (None: none)."""

    def register(self, address: int, nbytes: int, device: int) -> int:
        """Page-lock ``[address, address + nbytes)``; 0 on success, else the error code."""

    def unregister(self, address: int, device: int) -> int:
        """Undo :meth:`register` of the range starting at ``address``; 0 or the error code."""

    def clear_error(self) -> None:
        """Consume the error a failed call left pending on this thread."""

    def error_name(self, code: int) -> str:
        """A readable name for an error code."""


class CudaRuntime:
    """CUDA's runtime, through torch's bindings (and ``libcudart``'s ``cudaGetLastError``)."""

    def copy_device(self, tensors: Sequence[torch.Tensor]) -> int | None:
        for t in tensors:
            if t.device.type == "cuda":
                return t.device.index if t.device.index is not None else torch.cuda.current_device()
        return None

    def register(self, address: int, nbytes: int, device: int) -> int:
        with torch.cuda.device(device):  # a background thread would otherwise use device 0
            return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _PORTABLE))

    def unregister(self, address: int, device: int) -> int:
        with torch.cuda.device(device):
            return int(torch.cuda.cudart().cudaHostUnregister(address))

    def clear_error(self) -> None:
        lib = _libcudart()
        if lib is not None:
            lib.cudaGetLastError()
            return
        try:  # torch's kernel-launch check reads (and so consumes) the pending error
            torch.zeros(1, device="cuda")
        except RuntimeError:
            pass

    def error_name(self, code: int) -> str:
        lib = _libcudart()
        if lib is None:
            return f"cudaError {code}"
        return f"{lib.cudaGetErrorName(code).decode()} ({code})"


@functools.cache
def _libcudart() -> ctypes.CDLL | None:
    """The ``libcudart`` torch loaded (the same instance, whose per-thread last error torch reads);
    None when it cannot be found (linked statically)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line})
    except OSError:
        return None
    for path in paths:
        if not os.path.basename(path).startswith("libcudart"):
            continue
        try:
            lib = ctypes.CDLL(path)
            lib.cudaGetErrorName.restype = ctypes.c_char_p
            lib.cudaGetLastError.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


@functools.cache
def _cuda() -> CudaRuntime:
    return CudaRuntime()


def runtime() -> Runtime | None:
    """The runtime that pins memory: CUDA's when torch has a usable GPU, else None. The one seam
    between tierpoint and the CUDA runtime's registration calls."""
    return _cuda() if torch.cuda.is_available() else None


def copy_device(tensors: Sequence[torch.Tensor]) -> int | None:
    """The device whose copies into host memory pinning would speed up for ``tensors`` (None when
    there is nothing to pin for: no CUDA tensor, or no CUDA)."""
    rt = runtime()
    return None if rt is None else rt.copy_device(tensors)


_NEW, _PINNED, _UNPINNED, _RELEASED = range(4)


class PinnedRange:
    """The registration of one range of host memory (held by the memory's owner).

    ``register`` pins at most once (later calls return what the first one did); ``release``
    unregisters if pinned, and from then on the range is never pinned again.
    """

    def __init__(self) -> None:
        self._state = _NEW
        self._address = 0
        self._device = 0
        self._runtime: Runtime | None = None
        self._lock = threading.Lock()

    @property
    def pinned(self) -> bool:
        return self._state == _PINNED

    @property
    def device(self) -> int | None:
        """The device the range is pinned for (None: not pinned)."""
        return self._device if self._state == _PINNED else None

    def register(self, address: int, nbytes: int, device: int) -> bool:
        """Pin ``[address, address + nbytes)`` for copies from ``device``; True if pinned. A failure
        is logged once (WARNING) and leaves the memory as it was."""
        with self._lock:
            if self._state != _NEW or nbytes == 0:
                return self._state == _PINNED
            rt = runtime()
            if rt is None:
                return False
            code = rt.register(address, nbytes, device)
            if code != 0:
                rt.clear_error()
                self._state = _UNPINNED
                logger.warning(
                    "could not page-lock %d bytes of staging memory (%s): copies from the device "
                    "into it are synchronous and slower",
                    nbytes,
                    rt.error_name(code),
                )
                return False
            self._state, self._address, self._device, self._runtime = _PINNED, address, device, rt
            return True

    def release(self) -> None:
        """Unregister the range if it is pinned (before its memory is unmapped); idempotent."""
        with self._lock:
            state, self._state = self._state, _RELEASED
            if state != _PINNED or self._runtime is None:
                return
            try:
                code = self._runtime.unregister(self._address, self._device)
                if code != 0:
                    self._runtime.clear_error()
                    logger.debug("unpinning staging memory: %s", self._runtime.error_name(code))
            except Exception as e:  # noqa: BLE001 - at interpreter exit CUDA may be gone already
                logger.debug("unpinning staging memory: %s", e)


__all__ = ["CudaRuntime", "PinnedRange", "Runtime", "copy_device", "runtime"]
