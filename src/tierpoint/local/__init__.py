"""The node-local tier: part files on a RAM disk or local SSD, one directory per rank.

Public names: :class:`LocalCheckpointManager`, :class:`CkptID`, :class:`HeldPart` (a committed
part held for a reader in this process, see :meth:`LocalCheckpointManager.hold_own_part`), the
replication strategies :class:`CliqueReplicationStrategy` and :class:`LazyCliqueReplicationStrategy`,
the base class :class:`ReplicationStrategy` for a user's own strategy (NVRx's ``replicate``), and the
NVRx-compatible exception names :data:`CheckpointingException` and
:class:`SameMachineReplicationException`.

Inside, one idea per module, lower ones first: ``naming`` (file names and places), ``store`` (this
rank's files: scan, complete iterations, spares, retirement, holds), ``retrieval`` and
``node_reports`` (pure planning and merging), ``replication`` (strategies), ``jobs`` (the worker's
jobs), ``discovery`` (``find_latest``), ``agreement`` (what a save may write and keep), ``saving``
and ``recovery`` (components over the store), ``holds`` (a part held for a reader outside the
tier), and ``manager``, the facade with NVRx's names (``nvrx_names`` holds its file-name helpers).
"""

from ..errors import CheckpointingException, SameMachineReplicationException
from ..tensor_aware import BasicTensorAwareStateDict, TensorAwareStateDict
from .holds import HeldPart
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
    "HeldPart",
    "LazyCliqueReplicationStrategy",
    "LocalCheckpointManager",
    "ReplicationStrategy",
    "SameMachineReplicationException",
    "TensorAwareStateDict",
]
