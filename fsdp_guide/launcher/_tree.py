"""Nothing a rank starts outlives it: child subreapers, and ending a process tree (private).

A rank may start processes of its own: a ``subprocess.Popen``, data-loader workers slow to
exit, a server that daemonizes (forks twice and calls ``setsid``, leaving the rank's
process group and session). A kill aimed at the rank's group misses the last kind, and a
rank killed outright (``SIGKILL``, the OOM killer) cleans up nothing: its children are
handed to ``init`` and run on.

On Linux, while ranks run, both the ranks and the launching process are *child
subreapers* (``PR_SET_CHILD_SUBREAPER``): a process whose parent dies is handed to its
nearest subreaper ancestor, never to ``init``. Whatever a rank starts, however it detaches
itself, stays below the rank while the rank lives, and is handed to the launcher when the
rank dies. No process is added: a rank costs the launch its own fork, nothing more.

- A rank that returns or raises ends everything below it itself (:func:`end_below`:
  ``SIGTERM``, a short grace, then ``SIGKILL``) before it exits.
- The launcher stopping the ranks signals each rank's group and every process below the
  rank (:func:`signal_tree`).
- A rank killed outright leaves its processes to the launcher: children it did not start,
  in another process group than its own. :class:`Adopter` ends them before ``launch``
  returns.
- The launcher dying: each rank's parent-death signal (``_orphan.py``) kills everything
  below the rank, then the rank.

Off Linux, or where ``prctl`` is refused, a rank leads its own process group, and what
stays in that group is what gets stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable

from fsdp_guide.launcher._orphan import prctl
from fsdp_guide.launcher._rendezvous import FD_LOCK

__all__: list[str] = []

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
# Grace after SIGTERM for what a rank left running, then SIGKILL, repeated until nothing
# is left or the deadline passes.
LEFTOVER_GRACE_S = 0.5
_KILL_DEADLINE_S = 5.0


def become_subreaper() -> bool:
    """Make this process a child subreaper; ``False`` off Linux or where refused."""
    return prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _children_map() -> dict[int, list[int]]:
    """Every process's children, read from ``/proc/*/stat`` (ppid is the 4th field)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return children  # no /proc (off Linux): only process groups can be signalled
    for name in names:
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


def descendants(pid: int, roots: Iterable[int] | None = None) -> list[int]:
    """Every descendant of ``pid`` (zombies included), parents before their children.

    ``roots``: start from these children of ``pid`` only.

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
    todo = list(children.get(pid, []) if roots is None else roots)
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def children_of_self() -> list[int]:
    """This process's children, from ``/proc/self/task/*/children`` (a few small reads)."""
    found: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return _children_map().get(os.getpid(), [])
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children", "rb") as f:
                found += [int(p) for p in f.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/self/task/{tid}"):
                continue  # the thread ended meanwhile
            return _children_map().get(os.getpid(), [])  # a kernel without the file
        except OSError:
            continue
    return found


def signal_tree(pid: int, sig: int) -> None:
    """``sig`` to ``pid``'s process group (when it leads one) and every process below it."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    signal_each(descendants(pid), sig)


def signal_each(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _end(
    find: Callable[[], list[int]], reap: Callable[[], None], grace_s: float, term: bool
) -> None:
    """SIGTERM what ``find`` lists and a grace (when ``term``), then SIGKILL until none is left.

    ``reap`` collects those that exited, so that ``find`` stops listing them. A process
    forking while its siblings die leaves a child that the next round finds: ours, as
    subreaper, once its parent is dead.
    """
    if term:
        signal_each(find(), signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            reap()
            if not find():
                return
            time.sleep(0.01)
    deadline = time.monotonic() + _KILL_DEADLINE_S
    while time.monotonic() < deadline:
        reap()
        left = find()
        if not left:
            return
        signal_each(left, signal.SIGKILL)
        time.sleep(0.002)


def _reap_all() -> None:
    """Collect every exited child of this process (a rank: all of them are its tree's)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def has_children() -> bool:
    """Whether this process has a child, running or exited and not yet collected."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def end_below(grace_s: float = LEFTOVER_GRACE_S, term: bool = True) -> None:
    """End every process below this one (a rank at its end): nothing to do in the usual case.

    ``term``: SIGTERM and a grace first; else SIGKILL at once (the launcher died).
    """
    if not has_children():
        return
    me = os.getpid()
    _end(lambda: _running(descendants(me)), _reap_all, grace_s, term)
    _reap_all()


#: Every rank this process launched that is not closed yet (launches in several threads).
_RANKS: set[int] = set()
_STATE = threading.Lock()
_launches = 0  # launches running here now
_was_subreaper = False  # before the first of them


def add_rank(pid: int) -> None:
    """Count ``pid`` as a rank (call under ``FD_LOCK``, right after its fork)."""
    _RANKS.add(pid)


def remove_rank(pid: int) -> None:
    _RANKS.discard(pid)


class Adopter:
    """The launcher as child subreaper while its ranks run, and the end of what it adopts.

    A rank killed outright hands whatever it started to the launcher. Those are told
    apart from the launcher's own children (a resource tracker, a process another thread
    started) by two marks: they were not its children when the launch began, and they
    left the launcher's process group (a rank leads a group of its own, and what it
    starts stays there or leaves for another). Ranks, of this launch or of one running in
    another thread, are excluded by pid.
    """

    def __init__(self) -> None:
        self.active = False
        self._known: set[int] = set()
        self._group = os.getpgid(0)

    def __enter__(self) -> Adopter:
        global _launches, _was_subreaper
        with _STATE:
            if _launches == 0:
                _was_subreaper = _is_subreaper()
                self.active = _was_subreaper or become_subreaper()
            else:
                self.active = _was_subreaper or _is_subreaper()
            _launches += 1
        if self.active:
            self._known = set(children_of_self())
        return self

    def __exit__(self, *exc: object) -> None:
        global _launches
        with _STATE:
            _launches -= 1
            if _launches == 0 and not _was_subreaper:
                prctl(_PR_SET_CHILD_SUBREAPER, 0)
        self.active = False

    def adopted(self, ours: Iterable[int]) -> list[int]:
        """Children handed to this process since the launch began (not ``ours``)."""
        if not self.active:
            return []
        found = []
        # Under the lock that a launch holds from a rank's fork until it counts the rank.
        with FD_LOCK:
            skip = self._known | set(ours) | _RANKS
            for pid in children_of_self():
                if pid in skip:
                    continue
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if os.getpgid(pid) != self._group:
                        found.append(pid)
        return found

    def end(self, ours: Iterable[int], grace_s: float = LEFTOVER_GRACE_S) -> None:
        """End what was adopted and everything below it: SIGTERM, a grace, then SIGKILL."""
        ours = set(ours)
        roots = self.adopted(ours)
        if not roots:
            return  # the usual case: every rank ended what it started itself
        adoptees = set(roots)
        me = os.getpid()

        def find() -> list[int]:
            adoptees.update(self.adopted(ours))
            return _running(descendants(me, roots=adoptees))

        def reap() -> None:
            for pid in list(adoptees):
                with contextlib.suppress(ChildProcessError):
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        adoptees.discard(pid)
                        continue
                if _exited(pid):
                    adoptees.discard(pid)

        _end(find, reap, grace_s, term=True)


def _running(pids: list[int]) -> list[int]:
    return [p for p in pids if not _exited(p)]


def _exited(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] in (b"Z", b"X")


def _is_subreaper() -> bool:
    import ctypes

    from fsdp_guide.launcher._orphan import _libc

    libc = _libc()
    if libc is None:
        return False
    flag = ctypes.c_int(0)
    try:
        ok = libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0
    except AttributeError:
        return False
    return bool(ok and flag.value)
