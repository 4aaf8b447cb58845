"""Keep a rank from outliving the process that launched it (private).

A rank leads its own process group (so the supervisor can stop it with what it started),
which also means that a kill aimed at the launcher's group, like Jupyter's forced restart,
misses it. A rank left behind keeps looping in its collective and, when forked from a
kernel, keeps the kernel's listening sockets open, so the restarted kernel cannot bind its
ports. Two defences, both set up first thing in the rank:

- :func:`die_with_parent`: Linux's ``PR_SET_PDEATHSIG`` sends the rank a real-time signal
  when the launching thread dies, whatever killed it. The signal is blocked in every thread
  of the rank but one, which waits for it: it runs even while the main thread sits inside a
  C++ collective, kills everything below the rank (a child subreaper, ``_tree.py``), then
  the rank. Elsewhere a watchdog thread polls the parent pid.
- :func:`release_inherited_sockets`: a forked rank points every socket it inherited (other
  than its own rendezvous listener) at ``/dev/null``, so the launcher's ports are free the
  moment the launcher dies, even before the rank does.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import functools
import os
import signal
import stat
import sys
import time

__all__: list[str] = []

_PR_SET_PDEATHSIG = 1
_WATCHDOG_PERIOD_S = 0.2


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        # The interpreter's own symbols include libc's: no ctypes.util.find_library, which
        # runs ldconfig in a subprocess (slow, and a fork from a freshly forked rank).
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def prctl(option: int, value: int) -> bool:
    """Call Linux's ``prctl(option, value)``; ``False`` off Linux or when refused."""
    libc = _libc()
    try:
        return libc is not None and bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except AttributeError:
        return False


def _set_pdeathsig(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent thread dies."""
    return prctl(_PR_SET_PDEATHSIG, sig)


def _kill_own_group() -> None:
    # The rank and whatever it started (data-loader workers) share its process group.
    with contextlib.suppress(OSError):
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os._exit(1)


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_WATCHDOG_PERIOD_S)
    _kill_own_group()


#: A rank's parent-death signal: a real-time one, which libraries leave alone.
DEATH_SIGNAL = signal.SIGRTMAX - 2


def _die_with_everything_below() -> None:
    from fsdp_guide.launcher._tree import end_below

    end_below(term=False)  # the launcher is gone: SIGKILL at once, no grace
    _kill_own_group()


def _wait_for_parent_death() -> None:
    signal.sigwait({DEATH_SIGNAL})
    _die_with_everything_below()


def die_with_parent(parent_pid: int) -> None:
    """Make this rank, and everything below it, die when ``parent_pid`` (the launcher) dies.

    Call it before the rank starts any thread: the signal is blocked here, so every thread
    started later (torch's, gloo's, the user's) inherits the block, and only the waiting
    thread receives it. ``PR_SET_PDEATHSIG`` fires when the thread that started the rank
    exits; :func:`launch` blocks that thread until every rank has ended, so only the
    launcher's death fires it. The parent may have died before the call: then the rank is
    already an orphan, and the check of ``os.getppid()`` right after catches it.

    Args:
        parent_pid: The launcher's pid, read before the rank started.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {DEATH_SIGNAL})
    armed = _set_pdeathsig(DEATH_SIGNAL)
    if not armed:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {DEATH_SIGNAL})
    if os.getppid() != parent_pid:
        _die_with_everything_below()
    # A bare thread: threading.Thread.start would wait until it runs (a context switch on
    # a busy machine) for nothing; it lives until the rank exits.
    if armed:
        _thread.start_new_thread(_wait_for_parent_death, ())
    else:
        _thread.start_new_thread(_watch_parent, (parent_pid,))


def _open_fds() -> list[int]:
    for listing in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return sorted(int(name) for name in os.listdir(listing))
    return list(range(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024))


def release_inherited_sockets(keep: set[int]) -> int:
    """Point every inherited socket not in ``keep`` at ``/dev/null``; return how many.

    Only sockets hold ports; pipes are left alone, among them the sentinel pipe by which
    :mod:`multiprocessing` learns that this process exited. ``dup2`` rather than ``close``:
    the descriptor number stays taken, so a Python object of the launcher that still owns it
    closes ``/dev/null`` one day, not a socket this rank opened since under the same number.

    Args:
        keep: Descriptors this rank owns (its rendezvous listener).

    Returns:
        The number of sockets released.
    """
    devnull = os.open(os.devnull, os.O_RDWR)
    released = 0
    try:
        for fd in _open_fds():
            if fd <= 2 or fd in keep or fd == devnull:
                continue
            try:
                if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    continue
                os.dup2(devnull, fd)
            except OSError:
                continue  # closed meanwhile (the listing's own descriptor), or not ours
            released += 1
    finally:
        os.close(devnull)
    return released
