"""Start ranks, relay their output, collect their results, stop them all on failure (private).

The supervisor is a single-threaded loop in the caller's main thread. In a Jupyter
kernel that matters: output printed from the main thread lands in the cell that
called :func:`fsdp_guide.launch`, and the stop button's ``KeyboardInterrupt`` arrives
there too, so an interrupted run is always cleaned up.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from multiprocessing.context import BaseContext
from typing import Any

from fsdp_guide.errors import LaunchTimeout
from fsdp_guide.launcher import _worker
from fsdp_guide.launcher._checks import dumps_job
from fsdp_guide.launcher._hangs import HangWatch
from fsdp_guide.launcher._output import _emit, _Stream
from fsdp_guide.launcher._rendezvous import FD_LOCK
from fsdp_guide.launcher._reports import (
    Rank,
    exit_code,
    on_exit,
    read_pending,
    read_result,
    root_cause,
    wait_for_the_cause,
)
from fsdp_guide.launcher._stacks import StackFilter
from fsdp_guide.launcher._stop import TERMINATE_GRACE_S, close_all, stop_all
from fsdp_guide.launcher._tree import Adopter, add_rank

__all__: list[str] = []

# How the timeout's message names the option that raises it; the magic names its own.
TIMEOUT_OPTION = "`timeout=`"
# How long ranks may linger after every one has sent its result (a non-daemon thread or a
# child process keeps a rank alive) before they are stopped and the results returned.
_EXIT_GRACE_S = 3.0


def _listen(address: str) -> socket.socket:
    """A listening TCP socket on a free port of ``address``, for rank 0's store."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, 0))
    sock.listen(128)
    return sock


def _dump_stacks(ranks: list[Rank], grace_s: float = 1.0) -> None:
    """Ask ranks still running to print their Python stacks (faulthandler on SIGUSR1)."""
    # Only ranks that are ready have a SIGUSR1 handler; the signal would kill the others.
    running = [r for r in ranks if exit_code(r) is None and r.pid is not None]
    for r in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.pid, signal.SIGUSR1)  # type: ignore[arg-type]
    if running:
        time.sleep(grace_s)  # let the dumps reach the pipes; _drain prints them


def _exit_fd(pid: int | None) -> int | None:
    """A pidfd of ``pid``, readable once it exits; ``None`` where Linux has none (< 5.3)."""
    try:
        return os.pidfd_open(pid or 0)
    except (AttributeError, OSError):
        return None


def start_ranks(
    ctx: BaseContext,
    fn: Callable[..., Any] | bytes,
    world_size: int,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    backend: str,
    master_addr: str,
    master_port: int | None,
    pg_timeout_s: float,
) -> list[Rank]:
    """Start one process per rank; each gets private pipes for stdout, stderr and its result.

    With ``master_port=None`` we bind a free port and hand the listening socket to rank 0,
    which serves the rendezvous store on it: picking a free port and binding it later would
    leave a window in which another process can take it.
    """
    ranks: list[Rank] = []
    forked = ctx.get_start_method() == "fork"
    # A spawned rank gets its work pickled by us (``fn`` is then those bytes) and unpickles
    # it after redirecting its output (see _worker.run_rank); a forked rank shares our memory.
    job: Callable[..., Any] | bytes = (
        fn if forked or isinstance(fn, bytes) else dumps_job(fn, args, kwargs)
    )
    try:
        for rank in range(world_size):
            # Held while this rank's pipes are open in our process, so that a launch in
            # another thread does not fork a rank that inherits (and holds open) them.
            with FD_LOCK:
                listener = None
                if rank == 0 and master_port is None:
                    listener = _listen(master_addr)
                    master_port = int(listener.getsockname()[1])
                assert master_port is not None
                out_r, out_w = ctx.Pipe(duplex=False)
                err_r, err_w = ctx.Pipe(duplex=False)
                res_r, res_w = ctx.Pipe(duplex=False)
                probe_r, probe_w = ctx.Pipe(duplex=False)
                process = ctx.Process(  # type: ignore[attr-defined]
                    target=_worker.run_rank,
                    args=(
                        job,
                        rank,
                        world_size,
                        args if forked else (),  # inside ``job`` when spawned
                        kwargs if forked else {},
                        backend,
                        master_addr,
                        master_port,
                        pg_timeout_s,
                        (out_w, err_w, res_w, probe_w),
                        forked,
                        listener,
                        os.getpid(),
                    ),
                    name=f"fsdp_guide-rank{rank}",
                    daemon=False,
                )
                process.start()
                add_rank(process.pid or 0)
                # Opened at once: the next start collects exited children, this one too.
                exit_fd = _exit_fd(process.pid)
                # Close our copies of the write ends so EOF arrives when the rank exits, and so
                # ranks forked later do not inherit (and hold open) this rank's pipes.
                for w in (out_w, err_w, res_w, probe_w):
                    w.close()
                if listener is not None:
                    listener.close()  # rank 0 has its own copy now
            r = Rank(rank=rank, process=process, result=res_r, probe=probe_r, exit_fd=exit_fd)
            r.streams = [
                _Stream(rank, out_r, sys.stdout),
                _Stream(rank, err_r, sys.stderr, stacks=StackFilter()),
            ]
            ranks.append(r)
    except BaseException:
        stop_all(ranks)
        close_all(ranks)
        raise
    return ranks


def supervise(
    ranks: list[Rank],
    timeout: float,
    watch_collectives: bool = False,
    adopter: Adopter | None = None,
) -> list[Any]:
    """Relay output until every rank has reported; raise on the first failure or at timeout.

    With ``watch_collectives`` (gloo ranks), ranks that wait in different collectives
    while none makes progress are stopped within seconds (``_hangs.py``). ``adopter``
    ends, before returning or raising, what ranks that died left to this process.
    """
    pids = [r.process.pid or 0 for r in ranks]
    watch = HangWatch(watch_collectives)
    selector = selectors.DefaultSelector()
    for r in ranks:
        for s in r.streams:
            selector.register(s.conn.fileno(), selectors.EVENT_READ, ("stream", r, s))
        selector.register(r.result.fileno(), selectors.EVENT_READ, ("result", r, None))
        exit_fd = r.exit_fd if r.exit_fd is not None else r.process.sentinel
        selector.register(exit_fd, selectors.EVENT_READ, ("exit", r, None))
    deadline = time.monotonic() + timeout
    all_reported_at: float | None = None
    try:
        while not all(r.done and exit_code(r) is not None for r in ranks):
            if all(r.done and r.failure is None for r in ranks):
                all_reported_at = all_reported_at or time.monotonic()
                if time.monotonic() - all_reported_at > _EXIT_GRACE_S:
                    _report_lingering(ranks)
                    break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = [r.rank for r in ranks if exit_code(r) is None or not r.done]
                _dump_stacks(ranks)
                raise LaunchTimeout(
                    f"ranks {running} still running after {timeout:g} s; all ranks were "
                    "stopped (their stacks at that moment are printed above). Raise "
                    f"{TIMEOUT_OPTION} if the work is just slow, or look for a rank that "
                    "skipped a collective the others entered.",
                    ranks=running,
                    timeout=timeout,
                )
            for key, _ in selector.select(min(remaining, 0.5)):
                kind, r, s = key.data
                if kind == "stream":
                    data = os.read(s.conn.fileno(), 65536)
                    if data:
                        _emit(s, data)
                    else:
                        _emit(s, b"", final=True)
                        selector.unregister(key.fd)
                elif kind == "result":
                    if read_result(r):
                        selector.unregister(key.fd)
                    if exit_code(r) is not None:
                        on_exit(r)
                else:
                    selector.unregister(key.fd)
                    r.process.join()
                    on_exit(r)
            if any(r.failure is not None for r in ranks):
                wait_for_the_cause(ranks)
                stop_all(ranks)
                _drain(ranks)
                raise root_cause(ranks)
            mismatch = watch.check(ranks)
            if mismatch is not None:
                _print_stacks(ranks, watch.dumps)
                raise mismatch
        # Every rank has reported: stop what is still running in their process groups
        # (processes a rank started and left behind), then print what is left in the pipes.
        stop_all(ranks)
        if adopter is not None:
            adopter.end(pids)
        _read_streams_to_eof(selector, time.monotonic() + TERMINATE_GRACE_S)
    except BaseException:
        stop_all(ranks)
        if adopter is not None:
            adopter.end(pids)
        _drain(ranks)
        selector.close()
        close_all(ranks, wait_s=TERMINATE_GRACE_S)
        raise
    selector.close()
    close_all(ranks)
    return [r.value for r in ranks]


def _print_stacks(ranks: list[Rank], dumps: dict[int, str]) -> None:
    """Print the stacks the hang watch read, rewritten like those printed at timeout."""
    for r in ranks:
        if dumps.get(r.rank):
            stream = _Stream(r.rank, r.probe, sys.stderr, stacks=StackFilter())
            _emit(stream, dumps[r.rank].encode(), final=True)


def _report_lingering(ranks: list[Rank]) -> None:
    lingering = [r.rank for r in ranks if exit_code(r) is None]
    print(
        f"fsdp_guide.launch: ranks {lingering} sent their results but were still running "
        f"{_EXIT_GRACE_S:g} s later (a non-daemon thread or a child process not joined?); "
        "they were stopped.",
        file=sys.stderr,
    )


def _read_streams_to_eof(selector: selectors.BaseSelector, deadline: float) -> None:
    """After the ranks exit, print what is still in their pipes, up to end of file."""
    while any(key.data[0] == "stream" for key in selector.get_map().values()):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break  # a process the rank started still holds the pipe open
        for key, _ in selector.select(remaining):
            kind, _, s = key.data
            if kind != "stream":
                selector.unregister(key.fd)
                continue
            data = os.read(s.conn.fileno(), 65536)
            _emit(s, data, final=not data)
            if not data:
                selector.unregister(key.fd)
    for key in list(selector.get_map().values()):
        if key.data[0] == "stream":
            _emit(key.data[2], b"", final=True)


def _drain(ranks: list[Rank]) -> None:
    """Print what stopped ranks wrote before dying, and pick up error reports already sent."""
    for r in ranks:
        if not r.done:
            with contextlib.suppress(OSError, EOFError, ValueError):
                read_pending(r)
        for s in r.streams:
            try:
                while s.conn.poll():
                    data = os.read(s.conn.fileno(), 65536)
                    if not data:
                        break
                    _emit(s, data)
                _emit(s, b"", final=True)
            except (OSError, ValueError):
                pass
