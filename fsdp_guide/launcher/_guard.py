"""A guard process above each rank, so that nothing the rank started outlives it (private).

A rank may start processes of its own: a ``subprocess.Popen``, data-loader workers slow to
exit, a server that daemonizes (forks twice and calls ``setsid``, leaving the rank's
process group). A kill aimed at the rank's group misses the last kind, and a rank killed
outright (``SIGKILL``, the OOM killer, its parent-death signal when the launcher dies)
cleans up nothing: its children are handed to ``init`` and run on.

On Linux each launched process therefore splits in two first thing. The child becomes the
rank; the parent stays behind as its guard. The guard is a *child subreaper*
(``PR_SET_CHILD_SUBREAPER``): whatever the rank starts, however it detaches itself, is
handed to the guard when its own parent dies, never to ``init``. The guard sleeps until one
of three events, then kills every process below it and exits:

- the rank exits (returned, raised, was killed): what it left running gets ``SIGTERM`` and
  a short grace, then ``SIGKILL``; the guard then sends the rank's exit code on the
  rank's result pipe (so that the launcher need not wait for the guard's own exit) and
  exits with the rank's status;
- ``SIGTERM`` (the launcher stopping the ranks): the rank and everything below get it, and
  a short grace, then ``SIGKILL``;
- the launcher dies (the guard's parent-death signal, ``SIGHUP``): ``SIGKILL`` at once.

The rank dies with its guard (its parent-death signal is ``SIGKILL``). Only a ``SIGKILL``
aimed at the guard itself, which neither the launcher nor Jupyter sends, can leave a
detached descendant to ``init``; the launcher's kill of the rank's group still reaches the
others.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import NoReturn

from fsdp_guide.launcher._orphan import die_with_parent, prctl
from fsdp_guide.launcher._reports import EXITED, PROBE_SIGNAL

__all__: list[str] = []

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# Grace after SIGTERM, for the rank (its handler may save something) and for what a rank
# left running; then SIGKILL, repeated until nothing is left or the deadline passes.
_TERM_GRACE_S = 1.0
_LEFTOVER_GRACE_S = 0.5
_KILL_DEADLINE_S = 5.0
_WAKE = frozenset({signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP})
# Also blocked in the guard: an interrupt, and the stack-dump signals meant for the rank.
_BLOCKED = _WAKE | {signal.SIGINT, signal.SIGUSR1, PROBE_SIGNAL}
_KILLED = signal.SIGKILL  # a wait status of a process killed by SIGKILL is the signal number
_TERMINATED = signal.SIGTERM


def _children_map() -> dict[int, list[int]]:
    """Every process's children, read from ``/proc/*/stat`` (ppid is the 4th field)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        # The command name (2nd field) is in parentheses and may hold spaces or ")".
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    return children


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (zombies included), parents before their children.

    Examples:
        >>> import subprocess
        >>> child = subprocess.Popen(["sleep", "30"])
        >>> child.pid in descendants(os.getpid())
        True
        >>> child.kill(); child.wait()
        -9
    """
    children = _children_map()
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def _signal_below(sig: int) -> None:
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _reap(rank_pid: int) -> tuple[int | None, bool]:
    """Collect exited children: the rank's wait status if it was one, and whether none is left."""
    status = None
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status, True
        if pid == 0:
            return status, False
        if pid == rank_pid:
            status = st


def _wait(rank_pid: int, launcher_pid: int) -> tuple[int, bool]:
    """Sleep until the rank exits, the launcher dies, or SIGTERM's grace is over.

    Returns the wait status to end with, and whether everything below already got SIGTERM.
    """
    stop_at: float | None = None
    while True:
        if os.getppid() != launcher_pid:
            return _KILLED, False  # the launcher died: no grace (the signal may have come early)
        now = time.monotonic()
        if stop_at is not None and now >= stop_at:
            return _TERMINATED, True
        info = signal.sigtimedwait(_WAKE, 1.0 if stop_at is None else stop_at - now)
        if info is not None and info.si_signo == signal.SIGTERM and stop_at is None:
            _signal_below(signal.SIGTERM)
            stop_at = time.monotonic() + _TERM_GRACE_S
        status, _ = _reap(rank_pid)
        if status is not None:
            return status, stop_at is not None


def _end_everything_below(status: int, asked: bool) -> None:
    """SIGTERM and a grace unless already asked (or the rank was killed), then SIGKILL."""
    if _reap(-1)[1]:
        return  # the usual case: the rank left nothing behind
    if not asked and not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        _signal_below(signal.SIGTERM)
        deadline = time.monotonic() + _LEFTOVER_GRACE_S
        while not _reap(-1)[1] and time.monotonic() < deadline:
            signal.sigtimedwait({signal.SIGCHLD}, max(0.0, deadline - time.monotonic()))
    deadline = time.monotonic() + _KILL_DEADLINE_S
    # A process forking while its siblings die leaves a child that the next round finds:
    # it is ours, as subreaper, once its parent is dead.
    while not _reap(-1)[1] and time.monotonic() < deadline:
        _signal_below(signal.SIGKILL)
        time.sleep(0.002)


def _exit_like(status: int) -> NoReturn:
    """End this process the way the rank ended: the same exit code, or the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # not reached for a signal whose default is to terminate
    os._exit(os.waitstatus_to_exitcode(status))


def _guard(rank_pid: int, launcher_pid: int, report: Connection) -> NoReturn:
    try:
        status, asked = _wait(rank_pid, launcher_pid)
        _end_everything_below(status, asked)
        with contextlib.suppress(OSError):  # the launcher is gone
            report.send_bytes(EXITED + str(os.waitstatus_to_exitcode(status)).encode())
            report.close()
        _exit_like(status)
    finally:
        os._exit(1)


def split_off_guard(launcher_pid: int, close_in_guard: list[int], report: Connection) -> int | None:
    """Fork a rank below a guard: return the guard's pid in the rank; the guard never returns.

    Both halves arm their parent-death signal before anything else and then check that
    their parent is still the expected one, so a launcher (or guard) killed a moment
    before the signal was armed still takes them with it.

    Off Linux, or where ``prctl`` is refused, nothing is forked and ``None`` is returned:
    the rank then guards itself as well as it can (``_orphan.die_with_parent``) and its
    process group.

    Args:
        launcher_pid: The launching process; the guard kills everything when it dies.
        close_in_guard: Descriptors the guard must not hold (the rank's output pipes), so
            that their readers see end-of-file when the rank exits.
        report: The rank's result pipe, on which the guard sends the rank's exit code.
    """
    if not prctl(_PR_SET_CHILD_SUBREAPER, 1):
        return None
    # Set up before the fork, so that the guard can go to sleep at once and leave the CPU
    # to the rank: the parent-death signal is not inherited, and the signals the guard
    # waits for (or ignores) stay blocked in it, never handled; the rank unblocks them.
    prctl(_PR_SET_PDEATHSIG, signal.SIGHUP)
    if os.getppid() != launcher_pid:
        # The launcher died before the signal was armed (a spawned rank takes a while to
        # start): nothing will ever send it, and nothing is below us yet.
        os._exit(1)
    guard_pid = os.getpid()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
    rank_pid = os.fork()
    if rank_pid == 0:
        # First thing: a guard killed from here on takes the rank with it.
        die_with_parent(guard_pid)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        return guard_pid
    for fd in close_in_guard:
        with contextlib.suppress(OSError):
            os.close(fd)
    _guard(rank_pid, launcher_pid, report)
