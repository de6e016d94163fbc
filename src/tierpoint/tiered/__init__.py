"""Every tier behind one object: :class:`TieredCheckpointManager` (see :mod:`.manager`).

Public names: :class:`TieredCheckpointManager`, :class:`RankLocal` (a state value that differs
between ranks) and :class:`~tierpoint.errors.StateMismatchError`.
"""

from ..errors import StateMismatchError
from .manager import TieredCheckpointManager
from .state import RankLocal

__all__ = ["RankLocal", "StateMismatchError", "TieredCheckpointManager"]
