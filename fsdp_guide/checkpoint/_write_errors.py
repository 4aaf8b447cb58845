"""Write failures named for their cause: a full disk, a quota, a file size limit (private).

``torch.save`` writes through a Python file object from C++, and an ``OSError`` raised by
that object's ``write`` does not come back out: torch raises ``[enforce fail at
inline_container.cc] unexpected pos ...`` instead, which never says the disk is full (DCP
writes its files with ``torch.save`` too). :class:`RecordingFile` wraps the file and keeps
the first ``OSError`` its writes meet; :func:`named_write_error` then turns a failed write
whose cause was space into a :class:`~fsdp_guide.errors.CheckpointError` that names it, with
the free space of that filesystem and the bytes the save needs.
"""

from __future__ import annotations

import errno
import io
import shutil
from pathlib import Path
from typing import IO, Any

import torch

from fsdp_guide.errors import CheckpointError

# Out of space, out of quota, and a file larger than this process or filesystem allows.
_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class RecordingFile:
    """A binary file that remembers the first ``OSError`` of its writes, and counts bytes.

    Examples:
        >>> import io
        >>> handle = RecordingFile(io.BytesIO())
        >>> handle.write(b"abc"), handle.written, handle.error
        (3, 3, None)
    """

    def __init__(self, raw: IO[bytes] | io.IOBase) -> None:
        self.raw = raw
        self.error: OSError | None = None
        self.written = 0

    def write(self, data: Any) -> int:
        try:
            count = self.raw.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.written += count or 0
        return count

    def flush(self) -> None:
        try:
            self.raw.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:  # tell, fileno, seek...: the file's own
        return getattr(self.raw, name)


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in a nested structure, each storage counted once.

    Sharded tensors count their local part: what this process writes.

    Examples:
        >>> weight = torch.zeros(4, 2)
        >>> tensor_bytes({"w": weight, "view": weight[0], "steps": [torch.zeros(3)], "lr": 0.1})
        44
    """
    seen: set[int] = set()

    def count(item: Any) -> int:
        shards = getattr(item, "local_shards", None)
        if callable(shards):  # a ShardedTensor: the pieces this rank holds
            return sum(count(shard.tensor) for shard in shards())
        to_local = getattr(item, "to_local", None)
        if callable(to_local):  # a DTensor: its local piece
            item = to_local()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() in seen and storage.nbytes() > 0:
                return 0
            seen.add(storage.data_ptr())
            return int(storage.nbytes())
        if isinstance(item, dict):
            return sum(count(v) for v in item.values())
        if isinstance(item, list | tuple):
            return sum(count(v) for v in item)
        return 0

    return count(value)


def _space_cause(exc: BaseException, recorder: RecordingFile | None) -> OSError | None:
    for cause in (recorder.error if recorder else None, exc, exc.__cause__, exc.__context__):
        if isinstance(cause, OSError) and cause.errno in _SPACE:
            return cause
    return None


def _space(path: Path) -> str:
    """``"F of T bytes are free there"`` for the filesystem holding ``path``."""
    for directory in (path.parent, *path.parent.parents):
        if directory.exists():
            try:
                usage = shutil.disk_usage(directory)
            except OSError:
                break
            return f"{usage.free:,} of {usage.total:,} bytes are free there"
    return "its free space is unknown"


def named_write_error(
    exc: BaseException, recorder: RecordingFile | None, path: Path, needed: int | None
) -> CheckpointError | None:
    """A clear error for a write of ``path`` that failed for lack of space, else ``None``.

    Args:
        exc: What the write raised (torch's own error when it hid the ``OSError``).
        recorder: The file the write went through, if it was a :class:`RecordingFile`.
        path: The file being written.
        needed: Bytes this process's part of the save takes, when known.

    Examples:
        >>> import tempfile
        >>> full = OSError(errno.ENOSPC, "No space left on device")
        >>> print(named_write_error(full, None, Path(tempfile.mkdtemp()) / "a.pt", 10**6))
        no space left on the device holding ... (ENOSPC: No space left on device) while \
writing a.pt: ... bytes are free there and this process's part of the save takes about \
1,000,000 bytes. Free space or save elsewhere: the previous checkpoint is intact and this \
save's partial files are removed
        >>> named_write_error(OSError(errno.EACCES, "Permission denied"), None, Path("a"), 1)
    """
    cause = _space_cause(exc, recorder)
    if cause is None:
        return None
    name = errno.errorcode.get(cause.errno or 0, str(cause.errno))
    what = f"({name}: {cause.strerror})"
    written = f" after {recorder.written:,} bytes of it" if recorder and recorder.written else ""
    needs = f"about {needed:,} bytes" if needed else "an unknown number of bytes"
    if cause.errno == errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        allowed = (
            "the largest file this filesystem takes"
            if limit == resource.RLIM_INFINITY
            else f"this process's file size limit of {limit:,} bytes (ulimit -f)"
        )
        problem = f"{path.name} grew past {allowed} {what}{written}"
        fix = "Raise the limit or save kind='sharded' (smaller files)"
    else:
        where = "disk quota exceeded on" if cause.errno == errno.EDQUOT else "no space left on"
        problem = (
            f"{where} the device holding {path.parent} {what} while writing {path.name}"
            f"{written}: {_space(path)} and this process's part of the save takes {needs}"
        )
        fix = "Free space or save elsewhere"
    return CheckpointError(
        f"{problem}. {fix}: the previous checkpoint is intact and this save's partial files "
        "are removed"
    )


def raise_named(
    exc: BaseException, recorder: RecordingFile | None, path: Path, needed: int | None
) -> None:
    """Raise :func:`named_write_error`'s error from ``exc`` when there is one; else return."""
    named = named_write_error(exc, recorder, path, needed)
    if named is not None:
        raise named from exc
