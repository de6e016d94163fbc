"""tierpoint: fast, crash-consistent tiered checkpointing for distributed PyTorch training.

Public names live here and in the documented submodules (``tierpoint.fileformat``, ``tierpoint.tree``,
``tierpoint.dist``, ``tierpoint.tensor_aware``, ``tierpoint.local``, ``tierpoint.dcp``,
``tierpoint.asyncsave``, ``tierpoint.checkpointer``). :class:`TieredCheckpointManager` joins the
tiers; :class:`Checkpointer` is OLMo-core's trainer checkpointer.
"""

from .errors import (
    CheckpointingError,
    CheckpointingException,
    CoordinationTimeoutError,
    CorruptCheckpointError,
    SameMachineReplicationException,
    StateMismatchError,
    StorageUnavailableError,
    UnsupportedStateError,
)

__version__ = "0.1.0"

_LAZY = {
    "BasicTensorAwareStateDict": "tensor_aware",
    "BasicTrainModule": "checkpointer",
    "Checkpointer": "checkpointer",
    "CheckpointerConfig": "checkpointer",
    "RankLocal": "tiered",
    "TensorAwareStateDict": "tensor_aware",
    "TieredCheckpointManager": "tiered",
    "TrainModule": "checkpointer",
}
"""Names imported on first use: they import torch (the tiered manager every tier), which
``import tierpoint`` alone does not, so that ``tierpoint --help`` answers at once."""


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tierpoint' has no attribute {name!r}")


__all__ = [
    "BasicTensorAwareStateDict",
    "BasicTrainModule",
    "Checkpointer",
    "CheckpointerConfig",
    "CheckpointingError",
    "CheckpointingException",
    "CoordinationTimeoutError",
    "CorruptCheckpointError",
    "RankLocal",
    "SameMachineReplicationException",
    "StateMismatchError",
    "StorageUnavailableError",
    "TensorAwareStateDict",
    "TieredCheckpointManager",
    "TrainModule",
    "UnsupportedStateError",
    "__version__",
]
