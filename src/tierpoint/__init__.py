"""tierpoint: fast, crash-consistent tiered checkpointing for distributed PyTorch training.

Public names live here and in the documented submodules (``tierpoint.fileformat``, ``tierpoint.tree``,
``tierpoint.dist``, ``tierpoint.tensor_aware``).
"""

from .errors import (
    CheckpointingError,
    CheckpointingException,
    CoordinationTimeoutError,
    CorruptCheckpointError,
    SameMachineReplicationException,
    UnsupportedStateError,
)
from .tensor_aware import BasicTensorAwareStateDict, TensorAwareStateDict

__version__ = "0.1.0"

__all__ = [
    "BasicTensorAwareStateDict",
    "CheckpointingError",
    "CheckpointingException",
    "CoordinationTimeoutError",
    "CorruptCheckpointError",
    "SameMachineReplicationException",
    "TensorAwareStateDict",
    "UnsupportedStateError",
    "__version__",
]
