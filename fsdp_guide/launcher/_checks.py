"""The arguments of :func:`~fsdp_guide.launcher.launch`, checked before a process starts (private).

Each check raises with the fix in its message, so a mistake costs no rank startup: a bad
``world_size``, ``timeout``, backend or start method, a call that cannot be sent to a
spawned rank, or a fork that the CUDA state of this process forbids.
"""

from __future__ import annotations

import math
import os
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
    child cannot import: they travel to spawned ranks by value, or ranks are forked.

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


def visible_gpus() -> int:
    """The number of GPUs this process sees, counted without initialising CUDA.

    ``torch.cuda.is_available()`` initialises the CUDA driver, after which a forked child
    cannot use CUDA (and even torch's optimizers ask CUDA whether a graph is being
    captured); ``torch.cuda.device_count()`` asks NVML where it can, which leaves it alone.

    Returns:
        GPUs visible (``CUDA_VISIBLE_DEVICES`` applies); 0 with a CPU build of torch.

    Examples:
        >>> visible_gpus() >= 0
        True
    """
    import torch

    return int(torch.cuda.device_count())


def _gpu_count() -> int:
    return visible_gpus()


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
    """``"fork"`` or ``"spawn"``: ``"auto"`` forks in an interactive session without a GPU.

    With a GPU visible, forking is fragile: once this process has initialised the CUDA
    driver or run a backward pass (autograd then starts a thread per GPU), a forked child
    can use neither CUDA nor autograd. Spawned ranks start clean.
    """
    if start_method not in _START_METHODS:
        choices = ", ".join(repr(m) for m in _START_METHODS)
        raise ValueError(f"unknown start_method {start_method!r}; choose one of {choices}")
    if start_method == "auto":
        return "fork" if in_interactive_session() and _gpu_count() == 0 else "spawn"
    return start_method


def check_fork_is_safe() -> None:
    """Refuse to fork once CUDA or autograd's GPU threads exist here: a forked child could
    use neither (its first backward pass, or an optimizer's step, would fail)."""
    import torch

    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise RuntimeError(
            "cannot fork ranks: CUDA is already initialised in this process, and a forked "
            "child cannot use it. Restart the kernel (or interpreter), do not touch CUDA "
            "(no .cuda(), no torch.cuda calls) before launching, and create CUDA tensors "
            "inside the launched function instead."
        )
    if _gpu_count() > 0 and not _forked_child_works():
        raise RuntimeError(
            "cannot fork ranks: with a GPU visible, this process has already run a backward "
            "pass or initialised the CUDA driver (autograd then starts a thread per GPU), and "
            "a forked child can use neither autograd nor CUDA. Use launch() with "
            "start_method='spawn' (the default here: functions defined in a notebook travel "
            "by value), or restart the kernel and run forked cells before any training in "
            "the kernel itself."
        )


def _forked_child_works() -> bool:
    """Whether a forked child can run a backward pass and ask CUDA a question."""
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only, never return
        code = 1
        try:
            import torch

            torch.ones(1, requires_grad=True).sum().backward()  # type: ignore[no-untyped-call]
            if torch.cuda.device_count() > 0:  # what an optimizer's step asks CUDA
                torch.cuda.is_current_stream_capturing()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def dumps_job(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bytes:
    """What a spawned rank runs, pickled: functions and classes of an unnamed ``__main__``
    (a notebook cell, ``python -c``) by value, everything importable by reference."""
    job = (fn, args, dict(kwargs))
    if getattr(sys.modules.get("__main__"), "__file__", None):
        # A script: the spawned rank imports it again, so its names resolve there, and its
        # globals (an open file, a lock) need not be picklable.
        return pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
    import cloudpickle

    return bytes(cloudpickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))


def check_picklable(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> bytes:
    """The job a spawned rank unpickles; refuse, with the fix, one that cannot be pickled."""
    try:
        return dumps_job(fn, args, kwargs)
    except Exception as exc:
        raise TypeError(
            "start_method='spawn' must pickle the function and its arguments to send them to "
            f"each rank, and pickling failed ({type(exc).__name__}: {exc}). Pass plain data "
            "and CPU tensors, open files, sockets and locks inside the function, or use "
            "start_method='fork'."
        ) from exc
