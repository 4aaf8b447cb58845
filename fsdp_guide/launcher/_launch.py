"""Run a training function on N ranks: :func:`launch`.

A training function has the shape the FairScale and Lightning docs teach,
``train(rank, world_size, *args)``. :func:`launch` starts ``world_size`` processes,
initialises ``torch.distributed`` in each, runs the function, and returns every
rank's return value as a list ordered by rank. The same function runs unchanged
under ``torchrun``: :func:`launch` then sees ``RANK``/``WORLD_SIZE`` in the
environment and runs it in the current process.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Mapping
from typing import Any

from fsdp_guide.errors import LaunchError
from fsdp_guide.launcher import _supervisor
from fsdp_guide.launcher._checks import (
    Backend,
    StartMethod,
    check_call,
    check_fork_is_safe,
    check_picklable,
    check_timeout,
    check_world_size,
    resolve_backend,
    resolve_start_method,
)
from fsdp_guide.launcher._main_guard import check_main_guard
from fsdp_guide.launcher._process_group import run_under_torchrun
from fsdp_guide.launcher._rendezvous import MASTER_ADDR, master_port, under_torchrun


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

    Launch from one thread at a time: forking while other threads of a long-lived process
    are launching too has crashed children inside ``os.fork`` itself (seen in a test
    suite, not in this package's code).

    Each rank dies with the process that launched it, however that process ends (a kernel
    restarted after a crash, say), and a forked rank lets go at once of the sockets it
    inherited, so that a restarted kernel can bind its ports again: open any connection a
    rank needs (a database, a tracking service) inside ``fn``.

    Forked ranks run torch's CPU operators on one thread: GNU OpenMP, which CPU builds of
    torch use, deadlocks in a forked child that asks for more threads once the parent has
    used its pool. Spawned ranks share the cores (``cpu_count // world_size`` threads each,
    unless ``OMP_NUM_THREADS`` is set).

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

    Returns:
        The return value of each rank, ordered by rank. Values travel by pickle, so return
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
    fn, args, kwargs = check_call(fn, args, kwargs)
    timeout = check_timeout(timeout)
    if under_torchrun():
        return run_under_torchrun(fn, args, kwargs, backend, timeout)
    world_size = check_world_size(world_size)
    chosen_backend = resolve_backend(backend, world_size)
    method = resolve_start_method(start_method)
    if method == "fork":
        check_fork_is_safe()
    else:
        check_main_guard()
        check_picklable(fn, args, kwargs)

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already initialised in this process; "
            "launch starts its own in each rank. Call "
            "torch.distributed.destroy_process_group() first."
        )
    port = master_port()
    ctx = mp.get_context(method)
    ranks = _supervisor.start_ranks(
        ctx, fn, world_size, args, kwargs, chosen_backend, MASTER_ADDR, port, timeout
    )
    try:
        return _supervisor.supervise(ranks, timeout, watch_collectives=chosen_backend == "gloo")
    except LaunchError as err:
        # The supervisor's and selectors' frames say nothing about the failure; the rank's
        # own traceback is in the message.
        raise err.with_traceback(None) from None
