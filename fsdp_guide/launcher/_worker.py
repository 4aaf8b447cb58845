"""What runs inside each launched rank (private).

Kept apart from the supervisor so a spawned child imports as little as possible. A rank:

1. becomes leader of its own process group and a child subreaper, so that nothing it
   starts can leave its process tree (``_tree.py``), and arranges to die, with everything
   below it, with the launching process (``_orphan.py``): a killed kernel must not leave
   anything behind;
2. sends its stdout and stderr, at the file-descriptor level, into pipes that the
   supervisor reads line by line (C++ warnings from gloo included), and sends
   ``("ready", pid)`` once its stack dumps are set up;
3. initialises ``torch.distributed``, runs the user's function, destroys the group;
4. sends back a pickled ``("ok", value)``, ``("exit", status, argument, time)`` (it called
   ``sys.exit``) or ``("error", text, time)`` message, then ends whatever it left running.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import io
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

from fsdp_guide.launcher._orphan import die_with_parent, release_inherited_sockets
from fsdp_guide.launcher._process_group import init_launched_rank
from fsdp_guide.launcher._reports import PROBE_SIGNAL, READY
from fsdp_guide.launcher._tree import become_subreaper, end_below

__all__: list[str] = []

# Frames from these files are the launcher's plumbing, not the user's code.
_INTERNAL_FILES = frozenset({"_worker.py", "_process_group.py", "magic.py"})


def _redirect_stream(fd: int, conn: Connection) -> io.TextIOWrapper:
    """Point file descriptor ``fd`` at the write end of ``conn`` and wrap it for Python."""
    os.dup2(conn.fileno(), fd)
    conn.close()
    return io.TextIOWrapper(
        os.fdopen(fd, "wb", buffering=0, closefd=False),
        encoding="utf-8",
        errors="replace",
        line_buffering=True,
        write_through=True,
    )


def _keep_fd(conn: Connection) -> int:
    """The descriptor of ``conn``, which stays open for good (faulthandler writes to it)."""
    fd = os.dup(conn.fileno())
    conn.close()
    return fd


def _user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` without the launcher's own frames at its top."""
    tb = exc.__traceback__
    while tb is not None and os.path.basename(tb.tb_frame.f_code.co_filename) in _INTERNAL_FILES:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _error_payload(text: str) -> bytes:
    sys.stderr.flush()
    return pickle.dumps(("error", text, time.time()))


def _run_user_function(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    backend: str,
    pg_timeout_s: float,
    forked: bool,
    listener: socket.socket | None,
) -> Any:
    import torch
    import torch.distributed as dist

    if forked:
        # GNU OpenMP does not survive fork: once the parent has used its thread pool, a
        # forked child that runs a parallel region on more than one thread deadlocks.
        torch.set_num_threads(1)
    elif "OMP_NUM_THREADS" not in os.environ:
        # Share the cores between ranks instead of each rank claiming all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_launched_rank(rank, world_size, backend, pg_timeout_s, listener)
    value = fn(rank, world_size, *args, **kwargs)
    # Free the function's cyclic garbage here, on the main thread, while the group still
    # exists. Left to a later collection, it can run on gloo's thread (a Python comm-hook
    # callback allocating) and destroy there a DDP reducer that holds the group's last
    # reference: the group's destructor then joins its own thread, and the rank aborts.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    return value


def _rebuild_job(job: bytes) -> tuple[Callable[..., Any], tuple[Any, ...], Mapping[str, Any]]:
    """Unpickle what a spawned rank runs, here where a failure can be reported."""
    try:
        fn, args, kwargs = pickle.loads(job)
    except Exception as exc:
        raise RuntimeError(
            "this spawned rank could not rebuild the function or its arguments "
            f"({type(exc).__name__}: {exc}). A spawned rank is a fresh interpreter: the "
            "modules they come from must be importable there (on sys.path, installed), or "
            "use start_method='fork'."
        ) from None
    return fn, args, kwargs


def run_rank(
    fn: Callable[..., Any] | bytes,
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    backend: str,
    master_addr: str,
    master_port: int,
    pg_timeout_s: float,
    pipes: tuple[Connection, Connection, Connection, Connection],
    forked: bool,
    listener: socket.socket | None,
    launcher_pid: int,
) -> None:
    """Entry point of one rank; never raises, reports through the result pipe instead.

    ``fn`` is the function itself in a forked rank; in a spawned rank it is the pickled
    ``(fn, args, kwargs)``, unpickled after the output is redirected so that an import
    failure reaches the caller as this rank's error instead of dying unseen. ``pipes`` are
    the write ends of stdout, stderr, the result and the stack probe. The rank dies with
    ``launcher_pid``, and so does everything it starts (``_tree.py``).
    """
    stdout_w, stderr_w, result_w, probe_w = pipes
    with contextlib.suppress(OSError):  # already a group leader
        os.setpgid(0, 0)
    if forked:
        # A forked rank holds copies of the launcher's sockets (a kernel's five ports): let
        # them go, so they are free the moment the launcher dies. Spawned ranks inherit none.
        release_inherited_sockets({listener.fileno()} if listener is not None else set())
    # Before anything can start a process: whatever the rank starts stays below it.
    subreaper = become_subreaper()
    die_with_parent(launcher_pid)
    sys.stdout = _redirect_stream(1, stdout_w)
    sys.stderr = _redirect_stream(2, stderr_w)
    # On timeout the launcher sends SIGUSR1 first: every thread's stack then shows where
    # this rank is stuck (usually a collective that another rank never entered).
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a crash shows its stack
    # PROBE_SIGNAL writes the stacks to the launcher alone, which reads them to tell ranks
    # stuck in different collectives (``_hangs.py``) without printing anything.
    faulthandler.register(PROBE_SIGNAL, file=_keep_fd(probe_w), all_threads=True)
    result_w.send_bytes(READY + str(os.getpid()).encode())

    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
    )
    if backend == "gloo":
        # A gloo rank is a CPU rank. With a GPU visible, torch's CUDA paths would still
        # run in it (PowerSGD synchronises CUDA, FSDP2's default mesh picks the GPU by rank).
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        if isinstance(fn, bytes):
            fn, args, kwargs = _rebuild_job(fn)
        # What the rank inherited or imported is not its garbage: frozen, the collection
        # after the function scans only what the function made (ms, not 0.1 s with torch).
        gc.freeze()
        value = _run_user_function(
            fn, rank, world_size, args, kwargs, backend, pg_timeout_s, forked, listener
        )
    except SystemExit as exc:
        # sys.exit(n) in a rank is reported like a process exit status, not a traceback;
        # sys.exit("message") exits with status 1, and the message goes into the error.
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        shown = "" if exc.code is None else repr(exc.code)
        payload = pickle.dumps(("exit", code, shown, time.time()))
    except BaseException as exc:
        payload = _error_payload(_user_traceback(exc))
    else:
        try:
            payload = pickle.dumps(("ok", value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            payload = _error_payload(
                traceback.format_exc()
                + f"\nThe value returned by rank {rank} could not be pickled; return plain "
                "data (numbers, strings, lists, dicts, CPU tensors).\n"
            )
    try:
        result_w.send_bytes(payload)
    finally:
        result_w.close()
        sys.stdout.flush()
        sys.stderr.flush()
        if subreaper:
            # What the rank left running (a server, a worker slow to exit) gets SIGTERM, a
            # short grace, then SIGKILL; the launch ends once this process has exited.
            end_below()
