"""What the Checkpointer saves and loads: a train module (OLMo-core's three methods), and one for a
plain ``(model, optimizer, scheduler)``.

Call order (made by :class:`~tierpoint.checkpointer.Checkpointer`): on save
``state_dict_to_save()``; on load ``state_dict_to_load(metadata, optim=...)`` (``metadata``: the
torch DCP ``Metadata`` of ``model_and_optim/``, read without pickle), then the Checkpointer loads
the checkpoint into that dict in place, then ``load_state_dict(state_dict)``.

:class:`BasicTrainModule` uses torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` /
``set_*`` (``torch.distributed.checkpoint.state_dict``), so FSDP2 / DTensor models work as DCP
expects: keys are parameter names, and a checkpoint reshards onto another number of ranks.
Its dict is ``{"model": ..., "optim": ..., "scheduler": ...}`` (the last two when given).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..errors import CheckpointingError


@runtime_checkable
class TrainModule(Protocol):
    """The methods the Checkpointer calls (OLMo-core's ``TrainModule`` has them)."""

    def state_dict_to_save(self) -> dict[str, Any]:
        """The state to save (values: tensors, DTensors, plain values; nested dicts)."""
        ...

    def state_dict_to_load(
        self, metadata: Metadata, *, optim: bool | None = None
    ) -> dict[str, Any]:
        """A dict of the keys to load, holding tensors of the right shapes to load into.
        ``optim``: ``False`` model only, ``True`` optimizer state too, ``None`` whatever the
        checkpoint (``metadata``) holds."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply the loaded dict (the one ``state_dict_to_load`` returned, filled in)."""
        ...


class BasicTrainModule:
    """A :class:`TrainModule` over a model, an optional optimizer and an optional LR scheduler.

    ``options``: torch's ``StateDictOptions`` for ``get_*_state_dict`` / ``set_*_state_dict``
    (for example ``full_state_dict=True``); the defaults keep DTensor shards. The scheduler's
    state is saved and loaded with the optimizer's (not with ``load_optim_state=False``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        *,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optim = optim
        self.scheduler = scheduler
        self.options = options

    def state_dict_to_save(self, *, optim: bool | None = None) -> dict[str, Any]:
        state: dict[str, Any] = {"model": get_model_state_dict(self.model, options=self.options)}
        if self.optim is not None and optim is not False:
            state["optim"] = get_optimizer_state_dict(self.model, self.optim, options=self.options)
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def state_dict_to_load(
        self, metadata: Metadata, *, optim: bool | None = None
    ) -> dict[str, Any]:
        keys = metadata.state_dict_metadata
        has_optim = any(k.startswith("optim.") for k in keys)
        if optim and not has_optim:
            raise CheckpointingError(
                "load_optim_state=True, but the checkpoint has no optimizer state"
            )
        if optim and self.optim is None:
            raise CheckpointingError(
                "load_optim_state=True, but this train module has no optimizer"
            )
        load_optim = has_optim and self.optim is not None if optim is None else optim
        state: dict[str, Any] = {"model": get_model_state_dict(self.model, options=self.options)}
        if load_optim:
            state["optim"] = get_optimizer_state_dict(self.model, self.optim, options=self.options)
            if self.scheduler is not None and any(k.startswith("scheduler.") for k in keys):
                state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict["model"], options=self.options)
        if "optim" in state_dict:
            set_optimizer_state_dict(
                self.model, self.optim, state_dict["optim"], options=self.options
            )
        if "scheduler" in state_dict:
            self.scheduler.load_state_dict(state_dict["scheduler"])
