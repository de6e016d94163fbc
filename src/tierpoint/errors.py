"""The exceptions tierpoint raises.

Every failure a user can act on is a ``CheckpointingError`` (or a subclass), so one ``except`` clause
catches them all. Errors agreed across ranks carry ``failures``: a mapping from rank to that rank's
message, identical on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping


class CheckpointingError(RuntimeError):
    """A checkpoint could not be saved, found or loaded.

    ``failures`` maps each failing rank to its message when the error was agreed across ranks
    (see :func:`tierpoint.dist.agree`); it is empty for purely local errors.
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})

    def __reduce__(self) -> tuple:
        # Subclasses take other constructor arguments: rebuild from the message and attributes, so
        # every tierpoint error survives pickling (torch DCP gathers rank errors that way).
        return _rebuild, (type(self), str(self), self.__dict__)


def _rebuild(cls: type, message: str, attributes: dict) -> CheckpointingError:
    err = _bare(cls)
    CheckpointingError.__init__(err, message)
    err.__dict__.update(attributes)
    return err


def _bare(cls: type) -> CheckpointingError:
    """An uninitialised instance of the error class ``cls``. A class that also derives from a
    built-in error with its own layout (``FileExistsError``: ``OSError``) can only be made by that
    error's ``__new__``, so the built-in bases are tried in order."""
    for base in cls.__mro__:
        if base.__module__ == "builtins" and issubclass(base, BaseException):
            try:
                return base.__new__(cls)
            except TypeError:
                continue
    raise TypeError(f"cannot create an instance of {cls.__name__}")


class CorruptCheckpointError(CheckpointingError):
    """A checkpoint file is damaged, truncated, or not a checkpoint file at all."""

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"corrupt checkpoint file {path}: {reason}")
        self.path = path
        self.reason = reason


class UnsupportedStateError(CheckpointingError):
    """The state holds an object that cannot be stored without pickle (or cannot be taken apart
    at all: a state that is not a dict, a member whose ``state_dict()`` raises).

    ``key_path`` names where it sits, e.g. ``optimizer.param_groups[0].fn``.
    """

    def __init__(self, key_path: str, message: str) -> None:
        super().__init__(f"{key_path or '<root>'}: {message}")
        self.key_path = key_path


class StateMismatchError(CheckpointingError):
    """The state to restore into differs from the checkpoint: keys, shapes, dtypes or sharding."""


class CoordinationTimeoutError(CheckpointingError):
    """A collective among ranks did not complete within its timeout."""


class StorageUnavailableError(CheckpointingError):
    """The storage did not answer (refused connections, timeouts, throttling) after every retry:
    nothing is known to be wrong with the checkpoint, so it is not skipped for an older one."""


class SameMachineReplicationException(CheckpointingError):
    """Two members of a replication clique live on the same node, so a replica protects nothing."""


def agreed_error(type_name: str, message: str, failures: Mapping[int, str]) -> CheckpointingError:
    """An error of the tierpoint class named ``type_name`` (else :class:`CheckpointingError`) built
    from an agreed message, as every rank raises it after :func:`tierpoint.dist.agree`."""
    cls = _BY_NAME.get(type_name, CheckpointingError)
    err = _bare(cls)
    CheckpointingError.__init__(err, message, failures)
    return err


def register_agreed(cls: type[CheckpointingError]) -> type[CheckpointingError]:
    """Make ``cls`` (a :class:`CheckpointingError` subclass of a higher floor) one that agreed errors
    keep: when every failing rank raised it, every rank raises it (see :func:`agreed_error`)."""
    _BY_NAME[cls.__name__] = cls
    return cls


def error_text(error: BaseException) -> str:
    """``"<class>: <message>"`` for an error a rank reports to the others, naming the class once
    (an error wrapping an agreed message already starts with it)."""
    name, text = type(error).__name__, str(error)
    return text if text.startswith(f"{name}: ") else f"{name}: {text}"


def ends_cleanly(error: BaseException | None) -> bool:
    """Whether a ``with`` block left with ``error`` ended as cleanly as its end does: no exception,
    or ``sys.exit(0)`` / ``sys.exit()`` (the saves in flight are kept, not aborted)."""
    return error is None or (isinstance(error, SystemExit) and error.code in (None, 0))


def failed_on_ranks(what: str, failures: Mapping[int, str]) -> str:
    """The agreed message for ``what`` failing on the ranks of ``failures`` (rank -> message)."""
    ranks = sorted(failures)
    if len(ranks) == 1:
        return f"{what} failed on rank {ranks[0]}: {failures[ranks[0]]}"
    detail = "; ".join(f"rank {r}: {failures[r]}" for r in ranks)
    return f"{what} failed on ranks {', '.join(map(str, ranks))}: {detail}"


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``; anything else (``"no"``, ``None``, ``0``) raises
    :class:`CheckpointingError` naming the argument ``name``: a flag that turns checks off or
    pickle on must never be set by a truthy string."""
    if type(value) is not bool:
        raise CheckpointingError(f"{name} must be True or False, got {value!r}")
    return value


CheckpointingException = CheckpointingError
"""The name NVRx users know for :class:`CheckpointingError`."""

_BY_NAME = {
    c.__name__: c
    for c in (
        CheckpointingError,
        CorruptCheckpointError,
        UnsupportedStateError,
        CoordinationTimeoutError,
        SameMachineReplicationException,
        StateMismatchError,
        StorageUnavailableError,
    )
}

__all__ = [
    "CheckpointingError",
    "CheckpointingException",
    "CoordinationTimeoutError",
    "CorruptCheckpointError",
    "SameMachineReplicationException",
    "StateMismatchError",
    "StorageUnavailableError",
    "UnsupportedStateError",
]
