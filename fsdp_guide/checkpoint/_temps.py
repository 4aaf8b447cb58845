"""Temporary files of atomic writes: named for their writer, removed once it is gone (private).

A file is written under a hidden name beside its target and renamed over it at the end, so
a process killed half-way (SIGKILL, out of memory, a node lost) leaves that temporary file
behind, possibly as large as the checkpoint. Its name says who wrote it,
``.<target>.tmp-<host>-<pid>-<random>``, so that the next write of the same target can
remove the ones whose writer is gone: written on this host by a process that no longer
runs, or that runs but no longer has the file open (its pid was reused). A temporary file
of another host is left alone, since this host cannot tell whether its writer still runs;
that host's next save of the target removes it.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import uuid
from pathlib import Path

_UNSAFE = re.compile(r"[^A-Za-z0-9_.]")  # "-" separates the fields of the name


def this_host() -> str:
    """This host's name as temporary file names carry it (no ``-`` or path characters).

    Examples:
        >>> "-" in this_host() or "/" in this_host()
        False
    """
    return _UNSAFE.sub("_", socket.gethostname())[:64] or "host"


def temp_path(target: Path) -> Path:
    """A fresh temporary path beside ``target``, naming this host and process.

    Examples:
        >>> name = temp_path(Path("/ckpt/model.pt")).name
        >>> name.startswith(f".model.pt.tmp-{this_host()}-{os.getpid()}-")
        True
    """
    return target.parent / f".{target.name}.tmp-{this_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _pattern(target_name: str) -> re.Pattern[str]:
    # The host is optional: earlier versions named them ".<target>.tmp-<pid>-<hex8>".
    return re.compile(
        rf"\.{re.escape(target_name)}\.tmp-(?:(?P<host>[A-Za-z0-9_.]+)-)?(?P<pid>\d+)-[0-9a-f]{{8}}"
    )


def _has_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` still has ``path`` open; ``True`` when that cannot be told."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        entries = list(fds.iterdir())
    except FileNotFoundError:
        return not Path("/proc/self/fd").is_dir()  # no /proc here: assume it is writing
    except OSError:  # another user's process: its files are not ours to judge
        return True
    wanted = os.path.realpath(path)
    for entry in entries:
        with contextlib.suppress(OSError):
            if os.readlink(entry) == wanted:
                return True
    return False


def _writer_alive(pid: int, path: Path) -> bool:
    if pid == os.getpid():
        return True  # this process: another thread may be writing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # runs, as another user
    return _has_open(pid, path)


def stale_temps(target: Path) -> list[Path]:
    """Temporary files of ``target`` that no live process on this host is writing.

    Examples:
        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "model.pt"
        >>> dead = target.parent / f".model.pt.tmp-{this_host()}-999999999-0123abcd"
        >>> mine = temp_path(target)
        >>> _ = dead.write_bytes(b"partial"), mine.write_bytes(b"being written")
        >>> [p.name for p in stale_temps(target)] == [dead.name]
        True
    """
    pattern, host = _pattern(target.name), this_host()
    stale = []
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or match["host"] not in (None, host):
            continue
        path = Path(entry.path)
        if not _writer_alive(int(match["pid"]), path):
            stale.append(path)
    return sorted(stale)


def remove_stale_temps(target: Path) -> int:
    """Remove the temporary files :func:`stale_temps` finds; return the bytes freed.

    Examples:
        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "model.pt"
        >>> _ = (target.parent / f".model.pt.tmp-999999999-0123abcd").write_bytes(b"old")
        >>> remove_stale_temps(target), list(target.parent.iterdir())
        (3, [])
    """
    freed = 0
    for path in stale_temps(target):
        with contextlib.suppress(OSError):
            size = path.stat().st_size
            path.unlink()
            freed += size
    return freed
