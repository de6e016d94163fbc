"""The node-local tier: part files on a RAM disk or local SSD, one directory per rank.

Public names: :class:`LocalCheckpointManager`, :class:`CkptID`, the replication strategies
:class:`CliqueReplicationStrategy` and :class:`LazyCliqueReplicationStrategy`, and the NVRx-compatible exception
names :data:`CheckpointingException` and :class:`SameMachineReplicationException`.
"""

from ..errors import CheckpointingException, SameMachineReplicationException
from ..tensor_aware import BasicTensorAwareStateDict, TensorAwareStateDict
from .manager import LocalCheckpointManager
from .naming import CkptID
from .replication import CliqueReplicationStrategy, LazyCliqueReplicationStrategy

__all__ = [
    "BasicTensorAwareStateDict",
    "CheckpointingException",
    "CkptID",
    "CliqueReplicationStrategy",
    "LazyCliqueReplicationStrategy",
    "LocalCheckpointManager",
    "SameMachineReplicationException",
    "TensorAwareStateDict",
]
