"""Every error class of fsdp-guide, in one place.

Each keeps a built-in base, so ``except ValueError`` or ``except RuntimeError`` still catches
it. Launch failures form a small hierarchy: catch them all (:class:`LaunchError`) or tell a
failing rank (:class:`RankError`) from a run that took too long (:class:`LaunchTimeout`).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointError",
    "EngineUnavailableError",
    "LaunchError",
    "LaunchTimeout",
    "OptimizerMismatchError",
    "PlanError",
    "RankError",
]


class LaunchError(RuntimeError):
    """Base class of every failure of a multi-process launch."""


class RankError(LaunchError):
    """One rank failed; the other ranks were stopped.

    Attributes:
        rank: The rank that failed first.
        exitcode: The process exit status when it exited non-zero, else ``None``.
        signal_name: The name of the signal that killed it (``"SIGKILL"``), else ``None``.
        remote_traceback: The traceback text printed in the failing rank, when it raised.

    Examples:
        >>> err = RankError("rank 1 exited with status 3", rank=1, exitcode=3)
        >>> isinstance(err, LaunchError), err.rank, err.exitcode
        (True, 1, 3)
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exitcode: int | None = None,
        signal_name: str | None = None,
        remote_traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.signal_name = signal_name
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[Any, ...]:
        # The keyword-only attributes are not in ``args``: without this, unpickling (a launch
        # inside a process pool, say) fails with a TypeError instead of giving the error back.
        attributes = {
            "rank": self.rank,
            "exitcode": self.exitcode,
            "signal_name": self.signal_name,
            "remote_traceback": self.remote_traceback,
        }
        return (_rebuild, (type(self), str(self), attributes))


class LaunchTimeout(LaunchError, TimeoutError):
    """Not every rank finished within the launch timeout; all were stopped.

    Attributes:
        ranks: The ranks still running when the timeout expired.
        timeout: The timeout, in seconds.

    Examples:
        >>> err = LaunchTimeout("ranks [0] still running after 1.0 s", ranks=[0], timeout=1.0)
        >>> isinstance(err, TimeoutError), err.ranks
        (True, [0])
    """

    def __init__(self, message: str, *, ranks: list[int], timeout: float) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.timeout = timeout

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), {"ranks": self.ranks, "timeout": self.timeout}))


def _rebuild(cls: type[LaunchError], message: str, attributes: dict[str, Any]) -> LaunchError:
    return cls(message, **attributes)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked; the message says why and what to do.

    Examples:
        >>> isinstance(CheckpointError("missing shard"), RuntimeError)
        True
    """


class CollectiveCallError(RuntimeError):
    """A collective helper (``checkpoint.save``, say) was called on some ranks only.

    Raised within seconds by the ranks that did call it, instead of a hang until the
    process-group timeout. The usual cause is ``if rank == 0:`` around the call.

    Examples:
        >>> isinstance(CollectiveCallError("rank 1 did not call save"), RuntimeError)
        True
    """


class CollectiveMismatchError(LaunchError, CollectiveCallError):
    """The ranks wait in different collectives, so none can finish; all were stopped.

    Raised by :func:`~fsdp_guide.launcher.launch` within seconds of the moment no rank
    makes progress any more, instead of at the launch timeout: each rank calls the
    collectives in a different order, or one rank calls a collective the others skip.

    Attributes:
        calls: For each rank, the collective it waits in and where it was called.

    Examples:
        >>> err = CollectiveMismatchError("ranks disagree", calls={0: "all_reduce", 1: "barrier"})
        >>> isinstance(err, LaunchError), isinstance(err, CollectiveCallError), err.calls[1]
        (True, True, 'barrier')
    """

    def __init__(self, message: str, *, calls: dict[int, str]) -> None:
        super().__init__(message)
        self.calls = calls

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), {"calls": self.calls}))


class OptimizerMismatchError(ValueError):
    """The optimizer does not hold the parameters of the (wrapped) model it should train."""


class EngineUnavailableError(RuntimeError):
    """The engine cannot run on this machine (FairScale's FSDP without CUDA)."""


class MissingRequirementError(ValueError):
    """Something a strategy needs is not installed (an optional extra, a C++ compiler).

    Raised before any rank starts; the message is one line naming the fix. A ``ValueError``,
    so the command line reports it like other bad input (exit status 2).

    Examples:
        >>> isinstance(MissingRequirementError("pip install deepspeed"), ValueError)
        True
    """


class PlanError(ValueError):
    """A training run cannot be planned as asked (:func:`fsdp_guide.memory.plan`).

    Examples:
        >>> isinstance(PlanError("unknown strategy 'zero4'"), ValueError)
        True
    """


class CommandError(Exception):
    """Bad input found while running a command: printed as one line, exit status 2."""


class MetaInitError(ValueError):
    """A model built on the meta device could not be given its weights as asked.

    Raised before anything is allocated: a module with tensors of its own but no
    ``reset_parameters()`` to initialise them, or weights tied between modules.
    """
