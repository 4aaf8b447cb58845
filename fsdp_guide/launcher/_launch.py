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
from fsdp_guide.launcher._tree import Adopter


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
    same way: it runs in-process on the existing group, and every rank must call it.

    Nothing a rank starts outlives it. On Linux each rank is a child subreaper
    (``PR_SET_CHILD_SUBREAPER``): every process it starts stays below it, even one that
    leaves the rank's process group and session (a server that daemonizes), and is handed
    to the launching process, which also is one while ranks run, when the rank dies. When
    a rank ends, however it ends (it returned, raised or was killed), what it left running
    gets ``SIGTERM`` and, half a second later, ``SIGKILL``. When ``launch`` stops the
    ranks (another rank failed, the timeout, an interrupt), each rank and everything below
    it get ``SIGTERM`` and a second's grace, then ``SIGKILL``. A rank still alive a few
    seconds after sending its result (a non-daemon thread, say) is stopped the same way,
    and a line on stderr says so. Every rank and everything below it die with the process
    that launched them, however that process ends (a script killed with ``SIGKILL``, a
    kernel interrupted, restarted or killed), within about a second. Off Linux, a rank
    leads its own process group, and only what stays in that group is stopped. A forked
    rank lets go at once of the sockets it inherited, so that a restarted kernel can bind
    its ports again: open any connection a rank needs (a database, a tracking service)
    inside ``fn``.

    Two mistakes that would hang until ``timeout`` fail within seconds instead. ``launch``
    called inside a launched function on some ranks only (under ``if rank == 0:``) raises
    ``CollectiveCallError`` on those ranks after 5 s (the
    ``FSDP_GUIDE_ENTRY_TIMEOUT`` the checkpoint helpers use). With gloo on Linux, ranks
    that all wait in collectives that are not the same one (called in a different order,
    or one rank waits in a collective the others skipped) while no rank uses the CPU are
    stopped after about 4 s with ``CollectiveMismatchError``, which
    names each rank's collective and the line that called it; their stacks are printed. A
    rank that is only slow (computing, sleeping, reading, waiting on anything that is not a
    collective) is never reported this way: only ``timeout`` ends it.

    A gloo rank is a CPU rank: ``CUDA_VISIBLE_DEVICES`` is emptied in it, so that torch's
    code paths that turn to a visible GPU (FSDP2's default device mesh, PowerSGD, an
    optimizer's CUDA-graph check) stay on the CPU.

    A line of output longer than ``2**20`` characters is printed in pieces.

    Launch from one thread at a time: forking while other threads of a long-lived process
    are launching too has crashed children inside ``os.fork`` itself (seen in a test
    suite, not in this package's code).

    Forked ranks run torch's CPU operators on one thread: GNU OpenMP, which CPU builds of
    torch use, deadlocks in a forked child that asks for more threads once the parent has
    used its pool. Spawned ranks share the cores (``cpu_count // world_size`` threads each,
    unless ``OMP_NUM_THREADS`` is set).

    Args:
        fn: The training function. With ``start_method="spawn"`` it and its arguments are
            pickled to each rank: a function defined in a notebook travels by value
            (``cloudpickle``, with the globals it uses), one from a module by name.
        world_size: Number of ranks.
        args: Extra positional arguments for ``fn``.
        kwargs: Extra keyword arguments for ``fn``.
        backend: ``"auto"`` (NCCL with a GPU per rank, else gloo), ``"gloo"`` or ``"nccl"``.
        timeout: Seconds before all ranks are stopped and
            :class:`~fsdp_guide.errors.LaunchTimeout` is raised.
        start_method: ``"auto"`` (fork in a notebook or interactive prompt on a machine
            without a GPU, else spawn), ``"fork"`` or ``"spawn"``. With a GPU visible, a
            forked rank cannot use CUDA or autograd once this process has run a backward
            pass or initialised CUDA, so ``"auto"`` spawns there, at a cost of a few seconds
            per launch (each rank imports torch). A spawned rank imports the launching
            script again, so in a script the call must sit under
            ``if __name__ == "__main__":``.

    Returns:
        The return value of each rank, ordered by rank. Values travel by pickle, so return
        plain data or CPU tensors.

    Raises:
        ValueError: Bad ``world_size``, ``backend``, ``start_method`` or ``timeout``; NCCL
            with too few GPUs; ``MASTER_PORT`` not a port number or already in use. Raised
            before any process starts.
        TypeError: With spawn, a function or argument that cannot be pickled.
        RuntimeError: Fork requested while CUDA is initialised in this process (or, with
            a GPU visible, after a backward pass here), or a process group already
            initialised here outside ``torchrun``.
        LaunchError: Spawn requested from the top level of a script, outside
            ``if __name__ == "__main__":``. Raised before any process starts.
        RankError: A rank raised, exited non-zero, was killed, or returned a value that
            cannot be unpickled here; the others were stopped. A nested ``launch`` called
            on some ranks only makes those ranks raise
            ``CollectiveCallError``.
        LaunchError: ``CollectiveMismatchError``: The ranks waited in different collectives, so
            none could finish; their stacks were printed, all stopped.
        LaunchTimeout: Not every rank finished in time; their stacks were printed, all stopped.

    Examples:
        Each rank returns ten times its rank; the values come back ordered by rank:

        >>> launch(lambda rank, world_size: 10 * rank, world_size=2, start_method="fork")
        [0, 10]
    """
    fn, args, kwargs = check_call(fn, args, kwargs)
    timeout = check_timeout(timeout)
    if under_torchrun():
        return run_under_torchrun(fn, args, kwargs, backend, timeout)
    world_size = check_world_size(world_size)
    chosen_backend = resolve_backend(backend, world_size)
    method = resolve_start_method(start_method)
    job: bytes | None = None
    if method == "fork":
        check_fork_is_safe()
    else:
        check_main_guard()
        job = check_picklable(fn, args, kwargs)

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already initialised in this process; "
            "launch starts its own in each rank. Call "
            "torch.distributed.destroy_process_group() first."
        )
    port = master_port()
    ctx = mp.get_context(method)
    # What a rank killed outright leaves running is handed to this process meanwhile.
    with Adopter() as adopter:
        try:
            ranks = _supervisor.start_ranks(
                ctx, job or fn, world_size, args, kwargs, chosen_backend, MASTER_ADDR, port, timeout
            )
        except BaseException:
            adopter.end(())
            raise
        try:
            return _supervisor.supervise(
                ranks, timeout, watch_collectives=chosen_backend == "gloo", adopter=adopter
            )
        except LaunchError as err:
            # The supervisor's and selectors' frames say nothing about the failure; the
            # rank's own traceback is in the message.
            raise err.with_traceback(None) from None
