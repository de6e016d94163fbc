"""Non-tensor values a checkpoint pickled, loaded with torch's ``weights_only`` allow-list plus
numpy's arrays, dtypes and scalars (a data loader's ``np.random.get_state()``, OLMo-core's trainer
state).

Call order: :func:`weights_only_load` where ``torch.load(weights_only=True)`` would be called.

Invariants: numpy's pickles only name the array rebuild, ``numpy.dtype`` and the dtype classes,
which take shapes, dtype codes and raw bytes; an object array's items still go through the same
allow-list, so nothing named by a file runs. torch keeps its allowed globals process-wide, so the
numpy ones are added only while a load runs, and loads take turns (the values are small).
"""

from __future__ import annotations

import threading
from typing import IO, Any

import torch

_lock = threading.Lock()
_globals: list[Any] = []


def _numpy_globals() -> list[Any]:
    if not _globals:
        import numpy as np

        core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
        rebuild, scalar = core.multiarray._reconstruct, core.multiarray.scalar
        classes = getattr(np, "dtypes", None)  # each dtype's own class (numpy >= 1.25)
        dtype_classes = [getattr(classes, n) for n in dir(classes or object) if n.endswith("DType")]
        _globals.extend([np.ndarray, np.dtype, rebuild, scalar, *dtype_classes])
        _globals.extend(
            [
                (rebuild, "numpy.core.multiarray._reconstruct"),  # numpy 1's names, for its files
                (scalar, "numpy.core.multiarray.scalar"),
            ]
        )
    return _globals


def weights_only_load(stream: IO[bytes]) -> Any:
    """``torch.load(stream, map_location="cpu", weights_only=True)``, numpy values allowed too."""
    with _lock, torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(stream, map_location="cpu", weights_only=True)
