"""The node-local tier: part files on a RAM disk or local SSD, one directory per rank.

Public names: :class:`LocalCheckpointManager`, :class:`CkptID`, the replication strategies
:class:`CliqueReplicationStrategy` and :class:`LazyCliqueReplicationStrategy`, the base class
:class:`ReplicationStrategy` for a user's own strategy (NVRx's ``replicate``), and the NVRx-compatible exception
names :data:`CheckpointingException` and :class:`SameMachineReplicationException`.
"""

from ..errors import CheckpointingException, SameMachineReplicationException
from ..tensor_aware import BasicTensorAwareStateDict, TensorAwareStateDict
from .manager import LocalCheckpointManager
from .naming import CkptID
from .replication import (
    CliqueReplicationStrategy,
    LazyCliqueReplicationStrategy,
    ReplicationStrategy,
)

__all__ = [
    "BasicTensorAwareStateDict",
    "CheckpointingException",
    "CkptID",
    "CliqueReplicationStrategy",
    "LazyCliqueReplicationStrategy",
    "LocalCheckpointManager",
    "ReplicationStrategy",
    "SameMachineReplicationException",
    "TensorAwareStateDict",
]
