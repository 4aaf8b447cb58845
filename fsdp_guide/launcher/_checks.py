"""The arguments of :func:`~fsdp_guide.launcher.launch`, checked before a process starts (private).

Each check raises with the fix in its message, so a mistake costs no rank startup: a bad
``world_size``, ``timeout``, backend or start method, a call that cannot be sent to a
spawned rank, or a fork that the CUDA state of this process forbids.
"""

from __future__ import annotations

import math
import pickle
import sys
from collections.abc import Callable, Mapping
from typing import Any, Literal

Backend = Literal["auto", "gloo", "nccl"]
StartMethod = Literal["auto", "fork", "spawn"]

_BACKENDS = ("auto", "gloo", "nccl")
_START_METHODS = ("auto", "fork", "spawn")


def check_call(
    fn: object, args: object, kwargs: object
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """``fn``, ``args`` and ``kwargs`` of a launch, checked and normalised.

    Raises:
        TypeError: ``fn`` not callable (the result of calling it, say), ``args`` not a
            tuple or list, ``kwargs`` not a mapping.

    Examples:
        >>> check_call(print, ["hi"], None)
        (<built-in function print>, ('hi',), {})
    """
    if not callable(fn):
        raise TypeError(
            f"fn must be callable, got {type(fn).__name__}: pass the function itself, "
            "launch(train, ...), not the result of calling it, launch(train(...), ...)"
        )
    if not isinstance(args, tuple | list):
        raise TypeError(
            f"args must be a tuple of extra positional arguments, got {type(args).__name__} "
            f"{args!r}; for a single argument write args=({args!r},) with the trailing comma"
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a dict of keyword arguments, got {type(kwargs).__name__}")
    return fn, tuple(args), dict(kwargs or {})


def in_interactive_session() -> bool:
    """Whether we run in a Jupyter kernel or an interactive Python prompt.

    There, functions defined by the user live in an unnamed ``__main__`` that a spawned
    child cannot import, so ranks have to be forked.

    Examples:
        >>> in_interactive_session()  # under pytest
        False
    """
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    ipython = sys.modules.get("IPython")
    if ipython is not None:
        get_ipython = getattr(ipython, "get_ipython", None)
        if get_ipython is not None and get_ipython() is not None:
            return True
    return False


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, world_size: int) -> str:
    """Turn ``"auto"`` into ``"nccl"`` or ``"gloo"`` and check the choice against the machine.

    Args:
        backend: ``"auto"``, ``"gloo"`` or ``"nccl"``.
        world_size: Number of ranks on this machine; NCCL needs one GPU per rank.

    Returns:
        ``"nccl"`` when CUDA is available and there is a GPU per rank, else ``"gloo"``
        (for ``"auto"``); the given name otherwise.

    Raises:
        ValueError: For an unknown backend, or ``"nccl"`` with fewer GPUs than ranks.

    Examples:
        >>> resolve_backend("gloo", 4)
        'gloo'
        >>> resolve_backend("mpi", 2)
        Traceback (most recent call last):
        ...
        ValueError: unknown backend 'mpi'; choose one of 'auto', 'gloo', 'nccl'
    """
    if backend not in _BACKENDS:
        choices = ", ".join(repr(b) for b in _BACKENDS)
        raise ValueError(f"unknown backend {backend!r}; choose one of {choices}")
    gpus = _gpu_count()
    if backend == "auto":
        return "nccl" if 0 < world_size <= gpus else "gloo"
    if backend == "nccl" and world_size > gpus:
        raise ValueError(
            f"backend 'nccl' needs one GPU per rank: world_size={world_size} but {gpus} "
            "GPU(s) visible; use backend='gloo' (CPU) or a smaller world_size"
        )
    return backend


def check_timeout(timeout: object) -> float:
    """``timeout`` in seconds as a float; ``ValueError`` unless positive and finite."""
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ValueError(
            f"timeout must be a positive, finite number of seconds, got {timeout!r}; "
            "for a run without a practical limit pass a large number such as 86400"
        )
    return float(timeout)


def check_world_size(world_size: object) -> int:
    """``world_size`` itself, checked: the one world-size check of the package.

    Args:
        world_size: A number of ranks.

    Returns:
        ``world_size``, typed as an ``int``.

    Raises:
        ValueError: Unless it is an int >= 1 (a bool is not one).

    Examples:
        >>> check_world_size(4)
        4
        >>> check_world_size(0)
        Traceback (most recent call last):
        ...
        ValueError: world_size must be an int >= 1, got 0
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    return world_size


def resolve_start_method(start_method: str) -> str:
    """``"fork"`` or ``"spawn"``: ``"auto"`` forks in an interactive session only."""
    if start_method not in _START_METHODS:
        choices = ", ".join(repr(m) for m in _START_METHODS)
        raise ValueError(f"unknown start_method {start_method!r}; choose one of {choices}")
    if start_method == "auto":
        return "fork" if in_interactive_session() else "spawn"
    return start_method


def check_fork_is_safe() -> None:
    """Refuse to fork once CUDA is initialised here: a forked child cannot use it."""
    import torch

    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise RuntimeError(
            "cannot fork ranks: CUDA is already initialised in this process, and a forked "
            "child cannot use it. Restart the kernel (or interpreter), do not touch CUDA "
            "(no .cuda(), no torch.cuda calls) before launching, and create CUDA tensors "
            "inside the launched function instead."
        )


def check_picklable(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> None:
    """Refuse, with the fix, a call that a spawned rank could not unpickle."""
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(
            f"start_method='spawn' cannot run {getattr(fn, '__qualname__', fn)!r}: it is "
            "defined interactively (a notebook cell or prompt), and a spawned process starts "
            "a fresh interpreter that cannot import it. Use start_method='fork', or move the "
            "function into a .py module and import it."
        )
    for what, obj in (("the function", fn), ("args", args), ("kwargs", dict(kwargs))):
        try:
            pickle.dumps(obj)
        except Exception as exc:
            raise TypeError(
                f"start_method='spawn' must pickle {what} to send it to each rank, and "
                f"pickling failed ({type(exc).__name__}: {exc}). Lambdas and functions nested "
                "in other functions cannot be pickled: define the function at the top level "
                "of a module, or use start_method='fork'."
            ) from exc
