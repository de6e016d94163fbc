"""tierpoint: fast, crash-consistent tiered checkpointing for distributed PyTorch training.

Public names live here and in the documented submodules (``tierpoint.fileformat``, ``tierpoint.tree``,
``tierpoint.dist``, ``tierpoint.tensor_aware``, ``tierpoint.local``, ``tierpoint.dcp``,
``tierpoint.asyncsave``). :class:`TieredCheckpointManager` joins the tiers.
"""

from .errors import (
    CheckpointingError,
    CheckpointingException,
    CoordinationTimeoutError,
    CorruptCheckpointError,
    SameMachineReplicationException,
    StateMismatchError,
    UnsupportedStateError,
)
from .tensor_aware import BasicTensorAwareStateDict, TensorAwareStateDict

__version__ = "0.1.0"

_LAZY = {"RankLocal": "tiered", "TieredCheckpointManager": "tiered"}
"""Names imported on first use: the tiered manager pulls in every tier."""


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tierpoint' has no attribute {name!r}")


__all__ = [
    "BasicTensorAwareStateDict",
    "CheckpointingError",
    "CheckpointingException",
    "CoordinationTimeoutError",
    "CorruptCheckpointError",
    "RankLocal",
    "SameMachineReplicationException",
    "StateMismatchError",
    "TensorAwareStateDict",
    "TieredCheckpointManager",
    "UnsupportedStateError",
    "__version__",
]
