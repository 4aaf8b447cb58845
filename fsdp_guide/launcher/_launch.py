"""Run a training function on N ranks: :func:`launch` and :func:`dist_init`.

A training function has the shape the FairScale and Lightning docs teach,
``train(rank, world_size, *args)``. :func:`launch` starts ``world_size`` processes,
initialises ``torch.distributed`` in each, runs the function, and returns every
rank's return value as a list ordered by rank. The same function runs unchanged
under ``torchrun``: :func:`launch` then sees ``RANK``/``WORLD_SIZE`` in the
environment and runs it in the current process.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle
import socket
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal

from fsdp_guide.launcher import _supervisor

Backend = Literal["auto", "gloo", "nccl"]
StartMethod = Literal["auto", "fork", "spawn"]

_BACKENDS = ("auto", "gloo", "nccl")
_START_METHODS = ("auto", "fork", "spawn")
_MASTER_ADDR = "127.0.0.1"


def find_free_port(host: str = _MASTER_ADDR) -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    Args:
        host: The address to bind to.

    Returns:
        A port number another process may still take before you bind it.

    Examples:
        >>> 1024 <= find_free_port() <= 65535
        True
    """
    # Under the lock: a rank forked meanwhile by a launch in another thread would inherit
    # the socket and keep the port bound, so that this launch's rank 0 could not listen on it.
    with _supervisor.FD_LOCK, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


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


def _master_port() -> int | None:
    """``MASTER_PORT`` when set (checked); ``None``: rank 0 serves on a socket we bind."""
    value = os.environ.get("MASTER_PORT")
    if not value:
        return None
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ValueError(
            f"MASTER_PORT={value!r} is not a TCP port number (1-65535); set it to a free "
            "port, or unset it so that launch picks one"
        )
    with _supervisor.FD_LOCK, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Like torch's TCPStore, allow a port a finished run left in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((_MASTER_ADDR, port))
        except OSError as exc:
            raise ValueError(
                f"MASTER_PORT={port} cannot be used on {_MASTER_ADDR} ({exc.strerror}): "
                "another process holds it. Unset MASTER_PORT so that launch picks a free "
                "port, or set it to a free one."
            ) from None
    return port


def _check_timeout(timeout: object) -> float:
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


def _check_world_size(world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return world_size


def _resolve_start_method(start_method: str) -> str:
    if start_method not in _START_METHODS:
        choices = ", ".join(repr(m) for m in _START_METHODS)
        raise ValueError(f"unknown start_method {start_method!r}; choose one of {choices}")
    if start_method == "auto":
        return "fork" if in_interactive_session() else "spawn"
    return start_method


def _check_fork_is_safe() -> None:
    import torch

    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise RuntimeError(
            "cannot fork ranks: CUDA is already initialised in this process, and a forked "
            "child cannot use it. Restart the kernel (or interpreter), do not touch CUDA "
            "(no .cuda(), no torch.cuda calls) before launching, and create CUDA tensors "
            "inside the launched function instead."
        )


def _check_picklable(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> None:
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


def _under_torchrun() -> bool:
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _run_under_torchrun(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    backend: str,
    timeout: float,
) -> list[Any]:
    import torch
    import torch.distributed as dist

    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    created = not dist.is_initialized()
    if created:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        chosen = resolve_backend(backend, local_world)
        if chosen == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(chosen, timeout=timedelta(seconds=timeout))
    value = fn(rank, world_size, *args, **kwargs)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    # Destroyed on success only: after a failure, destroying the group can block this rank
    # on peers still inside a collective, and it would never exit for torchrun to notice.
    if created:
        dist.destroy_process_group()
    return gathered


def launch(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    backend: Backend = "auto",
    timeout: float = 300.0,
    start_method: StartMethod = "auto",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks.

    Each rank is a process with ``torch.distributed`` initialised (TCP rendezvous on
    127.0.0.1, on ``MASTER_PORT`` if set, else a free port). Each rank's stdout and stderr
    reach the caller whole lines at a time, prefixed ``"[rankN] "``. The process group is
    destroyed when the function returns.

    Under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set) nothing is started:
    ``fn`` runs once in this process on the existing rendezvous, and every rank gets the
    gathered list. ``world_size`` is then taken from the environment. There, an exception
    in ``fn`` propagates unchanged on its own rank (no :class:`RankError`), leaving the
    process group up (destroying it could block on peers inside a collective); the rank
    exits, ``torchrun`` stops its peers and exits non-zero. A rank started by
    :func:`launch` has the same environment, so ``launch`` called inside ``fn`` behaves the
    same way: every rank must call it, and it runs in-process on the existing group.

    When every rank has returned, processes they started and left running are stopped, and
    so is a rank still alive a few seconds after sending its result (a non-daemon thread,
    say); a line on stderr says so. A line of output longer than ``2**20`` characters is
    printed in pieces.

    Args:
        fn: The training function. With ``start_method="spawn"`` it must be importable
            (defined at the top level of a module).
        world_size: Number of ranks.
        args: Extra positional arguments for ``fn``.
        kwargs: Extra keyword arguments for ``fn``.
        backend: ``"auto"`` (NCCL with a GPU per rank, else gloo), ``"gloo"`` or ``"nccl"``.
        timeout: Seconds before all ranks are stopped and :class:`LaunchTimeout` is raised.
        start_method: ``"auto"`` (fork in a notebook or interactive prompt, else spawn),
            ``"fork"`` or ``"spawn"``.

    Launch from one thread at a time: forking while other threads of a long-lived process
    are launching too has crashed children inside ``os.fork`` itself (seen in a test
    suite, not in this package's code).

    Forked ranks run torch's CPU operators on one thread: GNU OpenMP, which CPU builds of
    torch use, deadlocks in a forked child that asks for more threads once the parent has
    used its pool. Spawned ranks share the cores (``cpu_count // world_size`` threads each,
    unless ``OMP_NUM_THREADS`` is set).

    Returns:
        The return value of each rank, ordered by rank. Values travel by pickle: return
        plain data or CPU tensors.

    Raises:
        ValueError: Bad ``world_size``, ``backend``, ``start_method`` or ``timeout``; NCCL
            with too few GPUs; ``MASTER_PORT`` not a port number or already in use. Raised
            before any process starts.
        TypeError: With spawn, a function or argument that cannot be sent to a new process.
        RuntimeError: Fork requested while CUDA is initialised in this process, or a
            process group already initialised here outside ``torchrun``.
        RankError: A rank raised, exited non-zero, was killed, or returned a value that
            cannot be unpickled here; the others were stopped.
        LaunchTimeout: Not every rank finished in time; their stacks were printed, all stopped.

    Examples:
        ``rank_and_sum`` all-reduces ``1 / world_size`` and returns its rank and the sum:

        >>> from fsdp_guide.examples import rank_and_sum
        >>> launch(rank_and_sum, world_size=2, backend="gloo", start_method="spawn")
        [(0, 1.0), (1, 1.0)]
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
    kwargs = dict(kwargs or {})
    timeout = _check_timeout(timeout)
    if _under_torchrun():
        return _run_under_torchrun(fn, tuple(args), kwargs, backend, timeout)
    world_size = _check_world_size(world_size)
    chosen_backend = resolve_backend(backend, world_size)
    method = _resolve_start_method(start_method)
    if method == "fork":
        _check_fork_is_safe()
    else:
        _check_picklable(fn, tuple(args), kwargs)

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already initialised in this process; "
            "launch starts its own in each rank. Call "
            "torch.distributed.destroy_process_group() first."
        )
    port = _master_port()
    ctx = mp.get_context(method)
    ranks = _supervisor.start_ranks(
        ctx,
        fn,
        world_size,
        tuple(args),
        kwargs,
        chosen_backend,
        _MASTER_ADDR,
        port,
        timeout,
    )
    return _supervisor.supervise(ranks, timeout)


def dist_init(
    rank: int,
    world_size: int,
    backend: str = "gloo",
    master_addr: str = _MASTER_ADDR,
    master_port: int | None = None,
    timeout: float = 300.0,
) -> None:
    """Initialise ``torch.distributed`` in a process you started yourself (``mp.spawn``).

    The FairScale docs call this helper without defining it. Every rank must agree on the
    address and port: the port comes from ``master_port``, else ``MASTER_PORT``, else 29500.
    With NCCL, the rank's GPU becomes the current device.

    Args:
        rank: This process's rank.
        world_size: Number of ranks.
        backend: ``"gloo"``, ``"nccl"`` or ``"auto"``.
        master_addr: Address of rank 0.
        master_port: Port of rank 0's rendezvous store.
        timeout: Seconds collectives wait before failing.

    Raises:
        ValueError: Bad ``world_size``, ``rank`` or backend.

    Examples:
        >>> import torch.distributed as dist
        >>> import fsdp_guide
        >>> fsdp_guide.dist_init(0, 1, master_port=fsdp_guide.find_free_port())
        >>> dist.get_world_size()
        1
        >>> dist.destroy_process_group()
    """
    world_size = _check_world_size(world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    chosen = resolve_backend(backend, world_size)
    port = master_port if master_port is not None else int(os.environ.get("MASTER_PORT", 29500))
    import torch
    import torch.distributed as dist

    if chosen == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        chosen,
        init_method=f"tcp://{master_addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )
