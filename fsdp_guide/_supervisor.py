"""Start ranks, relay their output, collect their results, stop them all on failure (private).

The supervisor is a single-threaded loop in the caller's main thread. In a Jupyter
kernel that matters: output printed from the main thread lands in the cell that
called :func:`fsdp_guide.launch`, and the stop button's ``KeyboardInterrupt`` arrives
there too, so an interrupted run is always cleaned up.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, TextIO

from fsdp_guide import _worker
from fsdp_guide.errors import LaunchTimeout, RankError

__all__: list[str] = []

_TERMINATE_GRACE_S = 2.0


@dataclass
class _Stream:
    rank: int
    conn: Connection
    sink: TextIO
    pending: bytes = b""


@dataclass
class _Rank:
    rank: int
    process: BaseProcess
    result: Connection
    streams: list[_Stream] = field(default_factory=list)
    done: bool = False
    value: Any = None
    failure: RankError | None = None
    failed_at: float = 0.0


def _emit(stream: _Stream, data: bytes, final: bool = False) -> None:
    """Print every complete line of ``data`` with the rank prefix; keep the rest pending."""
    buffer = stream.pending + data
    *lines, stream.pending = buffer.split(b"\n")
    if final and stream.pending:
        lines.append(stream.pending)
        stream.pending = b""
    if lines:
        prefix = f"[rank{stream.rank}] "
        text = "".join(f"{prefix}{line.decode('utf-8', 'replace')}\n" for line in lines)
        stream.sink.write(text)
        stream.sink.flush()


def _exit_failure(rank: int, exitcode: int | None) -> RankError:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        return RankError(f"rank {rank} was killed by {name}", rank=rank, signal_name=name)
    return RankError(
        f"rank {rank} exited with status {exitcode} without returning a result",
        rank=rank,
        exitcode=exitcode,
    )


def _kill_group(process: BaseProcess, sig: int) -> None:
    pid = process.pid
    if pid is None or process.exitcode is not None:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        # The rank has not become a group leader yet (or already left): signal it alone.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_all(ranks: list[_Rank]) -> None:
    """Terminate every rank and its children; escalate to SIGKILL after a short grace."""
    for r in ranks:
        _kill_group(r.process, signal.SIGTERM)
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for r in ranks:
        r.process.join(max(0.0, deadline - time.monotonic()))
    for r in ranks:
        if r.process.exitcode is None:
            _kill_group(r.process, signal.SIGKILL)
            r.process.join(5.0)
        else:
            # The leader is gone; make sure nothing it started survives.
            with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                os.killpg(r.process.pid or 0, signal.SIGKILL)


def start_ranks(
    ctx: BaseContext,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    backend: str,
    master_addr: str,
    master_port: int,
    pg_timeout_s: float,
) -> list[_Rank]:
    """Start one process per rank; each gets private pipes for stdout, stderr and its result."""
    ranks: list[_Rank] = []
    try:
        for rank in range(world_size):
            out_r, out_w = ctx.Pipe(duplex=False)
            err_r, err_w = ctx.Pipe(duplex=False)
            res_r, res_w = ctx.Pipe(duplex=False)
            process = ctx.Process(  # type: ignore[attr-defined]
                target=_worker.run_rank,
                args=(
                    fn,
                    rank,
                    world_size,
                    args,
                    kwargs,
                    backend,
                    master_addr,
                    master_port,
                    pg_timeout_s,
                    out_w,
                    err_w,
                    res_w,
                    ctx.get_start_method() == "fork",
                ),
                name=f"fsdp_guide-rank{rank}",
                daemon=False,
            )
            process.start()
            # Close our copies of the write ends so EOF arrives when the rank exits, and so
            # ranks forked later do not inherit (and hold open) this rank's pipes.
            for w in (out_w, err_w, res_w):
                w.close()
            r = _Rank(rank=rank, process=process, result=res_r)
            r.streams = [_Stream(rank, out_r, sys.stdout), _Stream(rank, err_r, sys.stderr)]
            ranks.append(r)
    except BaseException:
        stop_all(ranks)
        raise
    return ranks


def _read_result(r: _Rank) -> None:
    try:
        message = pickle.loads(r.result.recv_bytes())
    except (EOFError, OSError):
        return  # died before reporting; the exit status tells why
    r.done = True
    if message[0] == "ok":
        r.value = message[1]
    elif message[0] == "exit":
        _, code, failed_at = message
        if code != 0:
            r.failure = RankError(
                f"rank {r.rank} called sys.exit({code})", rank=r.rank, exitcode=code
            )
            r.failed_at = failed_at
        else:
            r.failure = RankError(
                f"rank {r.rank} called sys.exit(0) before returning a result",
                rank=r.rank,
                exitcode=0,
            )
            r.failed_at = failed_at
    else:
        _, text, failed_at = message
        last = text.strip().splitlines()[-1] if text.strip() else "an exception"
        r.failure = RankError(
            f"rank {r.rank} raised {last}\n\n--- traceback of rank {r.rank} ---\n{text}",
            rank=r.rank,
            remote_traceback=text,
        )
        r.failed_at = failed_at


def supervise(ranks: list[_Rank], timeout: float) -> list[Any]:
    """Relay output until every rank has reported; raise on the first failure or at timeout."""
    selector = selectors.DefaultSelector()
    for r in ranks:
        for s in r.streams:
            selector.register(s.conn.fileno(), selectors.EVENT_READ, ("stream", r, s))
        selector.register(r.result.fileno(), selectors.EVENT_READ, ("result", r, None))
        selector.register(r.process.sentinel, selectors.EVENT_READ, ("exit", r, None))
    deadline = time.monotonic() + timeout
    try:
        while not all(r.done and r.process.exitcode is not None for r in ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = [r.rank for r in ranks if r.process.exitcode is None or not r.done]
                raise LaunchTimeout(
                    f"ranks {running} still running after {timeout:g} s; all ranks were "
                    "stopped. Raise `timeout=` if the work is just slow, or look for a rank "
                    "that skipped a collective the others entered.",
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
                    selector.unregister(key.fd)
                    _read_result(r)
                else:
                    selector.unregister(key.fd)
                    r.process.join()
                    if not r.done and r.result.poll():
                        _read_result(r)
                    if r.failure is None and (not r.done or r.process.exitcode != 0):
                        r.done = True
                        r.failure = _exit_failure(r.rank, r.process.exitcode)
                        r.failed_at = time.time()
            if any(r.failure is not None for r in ranks):
                stop_all(ranks)
                _drain(ranks)
                raise _root_cause(ranks)
        _read_streams_to_eof(selector, time.monotonic() + _TERMINATE_GRACE_S)
    except BaseException:
        stop_all(ranks)
        _drain(ranks)
        raise
    finally:
        selector.close()
        for r in ranks:
            r.result.close()
            for s in r.streams:
                s.conn.close()
    return [r.value for r in ranks]


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


def _root_cause(ranks: list[_Rank]) -> RankError:
    """The failure that happened first: later ones are usually peers losing their connection."""
    failed = [r for r in ranks if r.failure is not None]
    first = min(failed, key=lambda r: r.failed_at)
    assert first.failure is not None
    return first.failure


def _drain(ranks: list[_Rank]) -> None:
    """Print what stopped ranks wrote before dying, and pick up error reports already sent."""
    for r in ranks:
        if not r.done:
            try:
                if r.result.poll():
                    _read_result(r)
            except (OSError, EOFError, ValueError):
                pass
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
