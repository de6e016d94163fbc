"""Tensor-aware state dicts: a state whose tensors can be taken out, moved and put back.

``BasicTensorAwareStateDict(state)`` keeps its own flattened view of ``state`` (see
:mod:`tierpoint.tree`); the caller's dict is never modified, so a save never leaves it hollow.
``state_dict`` hands out that same dict; once handed out, the flattened view is refreshed from it
before it is used (``to_flat``, ``pop_tensors``, device moves), so changes made through it count.

Call order used by checkpoint managers: ``to_flat()`` on save; ``from_flat(flat, devices)`` on load,
then ``restore_tensor_device()`` to put tensors back where they were saved from. Replication uses
``pop_tensors()`` / ``init_tensors()`` / ``insert_tensors()`` to move tensor payloads without the
skeleton.

A subclass written for NVRx implements NVRx's seven abstract methods only; :meth:`TensorAwareStateDict.to_flat`
(what a manager saves) has a default built on its ``state_dict`` or its attributes.

A rank that cannot store its state in a collective save (a lambda, an object) still joins the
save: :func:`for_collective_save` gives it a :class:`RefusedStateDict`, which raises that error where
the save reads the state (inside the save's agreement), so every rank raises it at once.

Invariants: every tensor's original device is remembered per tensor (CPU and CUDA tensors may mix); a
device that does not exist when restoring leaves the tensor on CPU and logs a note.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence, ValuesView
from typing import Any, NoReturn

import torch

from .errors import CheckpointingError, UnsupportedStateError
from .tree import PICKLE_HINT, FlatState, SkeletonError, flatten, unflatten

logger = logging.getLogger("tierpoint")


class TensorAwareStateDict(ABC):
    """A state dict that exposes its tensors separately from the rest of its structure.

    The abstract methods are exactly NVRx's, so a subclass written for NVRx works unchanged:
    :attr:`tensors`, :attr:`is_hollow`, :meth:`pop_tensors`, :meth:`insert_tensors`,
    :meth:`init_tensors`, :meth:`copy_tensors_to_cpu` and :meth:`restore_tensor_device`.

    What a checkpoint manager writes comes from :meth:`to_flat`, concrete here: the flattened form of
    the subclass's ``state_dict`` (an attribute, property or method) when it has one, else of its
    attributes (``vars(self)``, which is what NVRx pickles). Anything :mod:`tierpoint.tree` cannot
    store raises :class:`~tierpoint.errors.UnsupportedStateError` naming its key path. A load gives
    back a :class:`BasicTensorAwareStateDict` whose ``state_dict`` is that saved structure (tierpoint
    never unpickles a class from a file).
    """

    @property
    @abstractmethod
    def tensors(self) -> Iterable[torch.Tensor]:
        """The tensors, in a fixed order."""

    @property
    @abstractmethod
    def is_hollow(self) -> bool:
        """True after :meth:`pop_tensors` until tensors are inserted again."""

    @abstractmethod
    def pop_tensors(self) -> Sequence[torch.Tensor]:
        """Take the tensors out, leaving the structure hollow."""

    @abstractmethod
    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put tensors (in :attr:`tensors` order) back into a hollow state."""

    @abstractmethod
    def init_tensors(self) -> None:
        """Fill a hollow state with freshly allocated (uninitialised) tensors of the right shapes."""

    @abstractmethod
    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors by CPU copies, remembering their devices."""

    @abstractmethod
    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move tensors back to the devices they came from (where such a device exists)."""

    def values(self) -> ValuesView[Any]:
        """The object's attribute values (NVRx's default)."""
        return vars(self).values()

    def to_flat(self) -> FlatState:
        """The pickle-free flattened form written to part files (see the class docstring)."""
        if self.is_hollow:
            raise CheckpointingError(
                f"cannot save a hollow {type(self).__name__}: its tensors were popped "
                "(insert_tensors first)"
            )
        state = getattr(self, "state_dict", _NO_STATE)
        if callable(state) and not isinstance(state, Mapping):
            state = state()
        if state is _NO_STATE:
            state = dict(vars(self))
        return flatten(state, allow_pickle=bool(getattr(self, "allow_pickle", False)))


_NO_STATE = object()


class BasicTensorAwareStateDict(TensorAwareStateDict):
    """Wraps any nested dict/list/tuple state of tensors and plain values.

    Unlike NVRx's class of the same name, tensors may live on CPU or CUDA, and the wrapped dict is
    neither mutated nor left hollow. As with NVRx, :attr:`state_dict` is the wrapped dict itself
    (assignable), and changes made to it before a save are saved once :attr:`state_dict` was read
    (until then the state is the one flattened when it was wrapped: a change made through the
    caller's own reference alone is not seen).
    """

    _hint = PICKLE_HINT

    def __init__(
        self, state_dict: Any, *, allow_pickle: bool = False, hint: str = PICKLE_HINT
    ) -> None:
        """``hint``: what the error for an object that cannot be stored tells to do."""
        self.allow_pickle = allow_pickle
        self._hint = hint
        self._set_state(state_dict)

    def _set_state(self, state_dict: Any) -> None:
        """Flatten ``state_dict`` (refusing what cannot be stored) and keep it as the state."""
        flat = flatten(state_dict, allow_pickle=self.allow_pickle, hint=self._hint)
        self._init_from(flat, [str(t.device) for t in flat.tensors])
        self._state = state_dict
        self._handed_out = False

    def _init_from(self, flat: FlatState, devices: Sequence[str]) -> None:
        self._skeleton = flat.skeleton
        self._paths = list(flat.paths)
        self._tensors: list[torch.Tensor] | None = list(flat.tensors)
        self._devices = list(devices)
        self._popped_meta: list[tuple[torch.Size, torch.dtype]] | None = None  # once hollow
        self._state: Any = None  # the nested state, once built or given
        self._handed_out = False  # whether :attr:`state_dict` gave it out (it may have changed)

    def _sync(self) -> None:
        """Take in changes made through the dict :attr:`state_dict` handed out."""
        if self._handed_out and self._tensors is not None:
            devices = self._devices
            self._set_state(self._state)
            if len(devices) == len(self._devices):  # the devices tensors were saved from stay
                self._devices = devices

    def _tensors_changed(self) -> None:
        self._state, self._handed_out = None, False  # rebuilt from the tensors on next access

    @classmethod
    def from_flat(
        cls, flat: FlatState, devices: Sequence[str] | None = None, *, allow_pickle: bool = False
    ) -> BasicTensorAwareStateDict:
        """Build from a flattened state (as read from a part file) and each tensor's saved device."""
        obj = cls.__new__(cls)
        obj._init_from(
            flat, devices if devices is not None else [str(t.device) for t in flat.tensors]
        )
        obj.allow_pickle = allow_pickle
        return obj

    @property
    def paths(self) -> list[str]:
        return list(self._paths)

    @property
    def devices(self) -> list[str]:
        return list(self._devices)

    @property
    def tensors(self) -> list[torch.Tensor]:
        if self._tensors is None:
            raise CheckpointingError("the state dict is hollow: its tensors were popped")
        return list(self._tensors)

    @property
    def is_hollow(self) -> bool:
        return self._tensors is None

    @property
    def _meta(self) -> list[tuple[torch.Size, torch.dtype]]:
        """Each tensor's shape and dtype: kept when the tensors are popped, else read from them
        (a save's wrapper makes no per-tensor objects it does not need)."""
        if self._tensors is None:
            assert self._popped_meta is not None
            return self._popped_meta
        return [(t.shape, t.dtype) for t in self._tensors]

    def pop_tensors(self) -> list[torch.Tensor]:
        self._sync()
        tensors = self.tensors
        self._popped_meta = self._meta
        self._tensors = None
        return tensors

    def insert_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        if not self.is_hollow:
            raise CheckpointingError("insert_tensors needs a hollow state dict")
        tensors = list(tensors)
        if len(tensors) != len(self._meta):
            raise CheckpointingError(f"expected {len(self._meta)} tensors, got {len(tensors)}")
        for path, t, (shape, dtype) in zip(self._paths, tensors, self._meta):
            if t.shape != shape or t.dtype != dtype:
                raise CheckpointingError(
                    f"tensor {path!r}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}"
                )
        self._tensors = tensors
        self._tensors_changed()

    def init_tensors(self) -> None:
        if not self.is_hollow:
            raise CheckpointingError("init_tensors needs a hollow state dict")
        self._tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in self._meta]
        self._tensors_changed()

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        self._sync()
        self._tensors_changed()
        self._tensors = [
            t if t.device.type == "cpu" else t.to("cpu", non_blocking=non_blocking)
            for t in self.tensors
        ]

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        self._sync()
        self._tensors_changed()
        restored = []
        for path, t, device in zip(self._paths, self.tensors, self._devices):
            target = torch.device(device)
            if t.device == target:
                restored.append(t)
            elif _device_exists(target):
                restored.append(t.to(target, non_blocking=non_blocking))
            else:
                logger.info(
                    "tensor %r was saved from %s, which does not exist here: kept on CPU",
                    path,
                    device,
                )
                restored.append(t)
        self._tensors = restored

    def to_flat(self) -> FlatState:
        self._sync()
        return FlatState(self._skeleton, self.tensors, list(self._paths))

    @property
    def state_dict(self) -> Any:
        """The state: the dict this object was made from (or, after a load, one built once), the
        same object on every access; changes made to it are saved, as with NVRx."""
        tensors = self.tensors  # raises when hollow
        if self._state is None:
            try:
                self._state = unflatten(self._skeleton, tensors, allow_pickle=self.allow_pickle)
            except SkeletonError as e:  # a DTensor that does not fit its mesh here
                raise CheckpointingError(f"cannot rebuild the loaded state: {e}") from None
        self._handed_out = True
        return self._state

    @state_dict.setter
    def state_dict(self, state_dict: Any) -> None:
        self._set_state(state_dict)

    def __repr__(self) -> str:
        state = "hollow" if self.is_hollow else f"{len(self._meta)} tensors"
        return f"BasicTensorAwareStateDict({state})"


class RefusedStateDict(TensorAwareStateDict):
    """Stands in for a state this rank cannot store, keeping the ``error`` that refused it: a
    checkpoint manager's save still runs its collectives with it, and reading it (``to_flat``, where
    the local tier's save flattens the state inside its first agreement) raises ``error``, so every
    rank raises the same error at once instead of the other ranks waiting in the save's collectives
    until the timeout."""

    def __init__(self, error: CheckpointingError) -> None:
        self.error = error

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self.error

    @property
    def tensors(self) -> NoReturn:
        self._refuse()

    @property
    def is_hollow(self) -> bool:
        return False

    to_flat = pop_tensors = insert_tensors = init_tensors = _refuse
    copy_tensors_to_cpu = restore_tensor_device = _refuse


def for_collective_save(
    state: Any, hint: str = PICKLE_HINT, refusal: CheckpointingError | None = None
) -> TensorAwareStateDict:
    """``BasicTensorAwareStateDict(state, hint=hint)`` for a collective save, or, where ``state``
    holds what cannot be stored (:class:`UnsupportedStateError`) or this rank already refused it
    (``refusal``), a :class:`RefusedStateDict` that raises that inside the save's agreement, on
    every rank."""
    if refusal is not None:
        return RefusedStateDict(refusal)
    try:
        return BasicTensorAwareStateDict(state, hint=hint)
    except UnsupportedStateError as e:
        return RefusedStateDict(e)


def _device_exists(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        return device.index is None or device.index < torch.cuda.device_count()
    backend = getattr(torch, device.type, None)
    return bool(backend is not None and getattr(backend, "is_available", lambda: False)())
