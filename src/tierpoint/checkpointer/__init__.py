"""OLMo-core's ``Checkpointer`` on tierpoint: the same names, layout and behaviour, pickle-free.

``CheckpointerConfig(work_dir=...).build()`` gives a :class:`Checkpointer`; ``save`` /
``save_async`` / ``load`` take a :class:`TrainModule` (OLMo-core's three methods;
:class:`BasicTrainModule` wraps a plain model, optimizer and scheduler) and each rank's trainer
state. Run directories are OLMo-core's (``step<N>/train/``, ``step<N>/model_and_optim/``,
``step<N>/.metadata.json``), and those OLMo-core wrote load too.

Modules: :mod:`.checkpointer` (save and load), :mod:`.config`, :mod:`.discovery` (layout, finding
and removing checkpoints), :mod:`.metadata` (``.metadata.json``), :mod:`.trainer_state` (per-rank
files), :mod:`.train_module`, :mod:`.future` (the future ``save_async`` returns), :mod:`.errors`.
"""

from .checkpointer import Checkpointer
from .config import CheckpointerConfig
from .errors import CheckpointExistsError, CheckpointNotFoundError
from .future import CheckpointFuture
from .metadata import CheckpointMetadata
from .train_module import BasicTrainModule, TrainModule

__all__ = [
    "BasicTrainModule",
    "CheckpointExistsError",
    "CheckpointFuture",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CheckpointerConfig",
    "TrainModule",
]
