"""Tell ranks stuck in different collectives from slow ones, within seconds (private).

Ranks that call collectives in a different order (rank 0 ``all_reduce`` then ``broadcast``,
rank 1 the other way round) wait for each other forever: gloo only gives up at the
process-group timeout, 300 s by default. The launcher can tell much sooner, from two
things it can see without the ranks' help:

- **no rank makes progress**: a rank blocked in a collective uses no CPU, so when no rank
  used more than a sliver of CPU for :data:`QUIET_S`, every rank is waiting on something;
- **what they wait in**: a real-time signal makes a rank write every thread's stack to a
  pipe that only the launcher reads (faulthandler, which works while a rank is inside C++). A rank
  whose innermost frame is a ``torch.distributed`` collective waits in that collective,
  called from the first frame of the user's code below it.

When every rank waits in a collective and they are not all the same call (name and call
site), no rank can finish. The verdict needs two looks :data:`CONFIRM_S` apart, with no CPU
used in between, that agree. A slow rank is never a mismatch: it uses CPU, or it waits in
something other than a collective (``time.sleep``, I/O, a lock), and the watch stays
silent, leaving the launch timeout to end it. Only gloo ranks on Linux are watched (NCCL
collectives return before the GPU has run them; CPU time comes from ``/proc``).
"""

from __future__ import annotations

import os
import re
import selectors
import time
from dataclasses import dataclass

from fsdp_guide.errors import CollectiveMismatchError
from fsdp_guide.launcher._reports import PROBE_SIGNAL, Rank
from fsdp_guide.launcher._stacks import is_user_frame

__all__: list[str] = []

QUIET_S = 2.0
CONFIRM_S = 2.0
# CPU seconds per wall second above which a rank counts as working (a blocked rank: ~0).
_BUSY_CPU = 0.03
_SAMPLE_EVERY_S = 0.5
_PROBE_WAIT_S = 1.0
_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ .*\(most recent call first\):$")
_FRAME = re.compile(r'^  File "(?P<path>.+)", line (?P<line>\d+) in (?P<name>.+)$')
_C10D = ("/torch/distributed/distributed_c10d.py", "/torch/distributed/c10d_logger.py")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Call:
    """A collective a rank waits in: its name and where the user's code called it."""

    name: str
    site: str

    def __str__(self) -> str:
        return f"{self.name}, called at {self.site}"


def _main_thread(text: str) -> list[tuple[str, str, str]]:
    """The frames (path, line, function) of the thread running the rank, innermost first."""
    blocks: list[list[tuple[str, str, str]]] = []
    for line in text.splitlines():
        if _HEADER.match(line):
            blocks.append([])
        elif blocks and (m := _FRAME.match(line)):
            blocks[-1].append((m["path"], m["line"], m["name"]))
    for frames in blocks:
        if any(path.endswith(os.path.join("launcher", "_worker.py")) for path, _, _ in frames):
            return frames
    return []


def waiting_in(text: str) -> Call | None:
    """The collective a rank's stack dump shows its main thread waiting in, if any.

    Examples:
        >>> dump = "\\n".join([
        ...     "Current thread 0x1 (most recent call first):",
        ...     '  File "/x/torch/distributed/distributed_c10d.py", line 9 in all_reduce',
        ...     '  File "/x/torch/distributed/c10d_logger.py", line 8 in wrapper',
        ...     '  File "/home/me/train.py", line 12 in train',
        ...     '  File "/y/fsdp_guide/launcher/_worker.py", line 70 in run_rank',
        ... ])
        >>> print(waiting_in(dump))
        all_reduce, called at /home/me/train.py, line 12 in train
    """
    frames = _main_thread(text)
    if not frames or not frames[0][0].endswith(_C10D):
        return None
    inner = 0
    name = frames[0][2]
    while inner < len(frames) and frames[inner][0].endswith(_C10D):
        if frames[inner][0].endswith(_C10D[0]):
            name = frames[inner][2]  # the outermost: broadcast_object_list, not broadcast
        inner += 1
    below = frames[inner:]
    site = next((f for f in below if is_user_frame(f[0])), below[0] if below else None)
    where = f"{site[0]}, line {site[1]} in {site[2]}" if site else "an unknown place"
    return Call(name=name, site=where)


def _cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime


def probe(ranks: list[Rank]) -> dict[int, str]:
    """Every rank's stack dump, as text, read from its probe pipe (empty if none came)."""
    selector = selectors.DefaultSelector()
    texts = {r.rank: b"" for r in ranks}
    try:
        for r in ranks:
            selector.register(r.probe.fileno(), selectors.EVENT_READ, r.rank)
        for key, _ in selector.select(0):  # a late answer to an earlier probe
            os.read(key.fd, 1 << 20)
        for r in ranks:
            if r.pid is not None:
                os.kill(r.pid, PROBE_SIGNAL)
        deadline = time.monotonic() + _PROBE_WAIT_S
        # A dump is written at once, in the signal handler: once every rank has written,
        # a short silence means it is complete.
        while (remaining := deadline - time.monotonic()) > 0:
            settled = all(texts.values())
            events = selector.select(min(0.05, remaining) if settled else remaining)
            if not events and settled:
                break
            for key, _ in events:
                texts[key.data] += os.read(key.fd, 1 << 16)
    except OSError:  # a rank exited meanwhile (ProcessLookupError), or its pipe closed
        return {}
    finally:
        selector.close()
    return {rank: data.decode("utf-8", "replace") for rank, data in texts.items()}


class HangWatch:
    """Looks at the ranks while the supervisor waits; says when they cannot finish."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and os.path.isdir("/proc")
        self._sampled_at = 0.0
        self._cpu: dict[int, float] = {}
        self._quiet_since: float | None = None
        self._seen: tuple[float, dict[int, Call]] | None = None  # a mismatch seen once
        self.dumps: dict[int, str] = {}

    def _reset(self) -> None:
        self._cpu, self._quiet_since, self._seen = {}, None, None

    def _all_quiet(self, ranks: list[Rank], now: float) -> bool:
        """Sample CPU time; whether no rank has worked since the last sample."""
        cpu = {r.rank: _cpu_seconds(r.pid or 0) for r in ranks}
        elapsed = now - self._sampled_at
        quiet = bool(self._cpu) and all(
            (seconds := cpu[rank]) is not None
            and seconds - self._cpu.get(rank, seconds) <= _BUSY_CPU * elapsed
            for rank in cpu
        )
        self._cpu = {rank: s for rank, s in cpu.items() if s is not None}
        self._sampled_at = now
        return quiet

    def check(self, ranks: list[Rank]) -> CollectiveMismatchError | None:
        """Called on every turn of the supervisor's loop; cheap unless the ranks are idle."""
        now = time.monotonic()
        if not self.enabled or now - self._sampled_at < _SAMPLE_EVERY_S:
            return None
        live = [r for r in ranks if r.pid is not None and not r.done]
        if len(live) < 2 or len(live) != len(ranks):
            self._reset()
            return None
        if not self._all_quiet(live, now):
            self._quiet_since, self._seen = now, None
            return None
        if self._quiet_since is None:
            self._quiet_since = now
        if now - self._quiet_since < QUIET_S or (
            self._seen is not None and now - self._seen[0] < CONFIRM_S
        ):
            return None
        dumps = probe(live)
        calls = _mismatch({rank: waiting_in(text) for rank, text in dumps.items()})
        if calls is None or len(calls) != len(live):
            self._quiet_since, self._seen = time.monotonic(), None  # look again later
            return None
        if self._seen is None or self._seen[1] != calls:
            self._seen = (time.monotonic(), calls)
            return None
        self.dumps = dumps
        return _error(calls, now - self._quiet_since)


def _mismatch(calls: dict[int, Call | None]) -> dict[int, Call] | None:
    """The calls, when every rank waits in one and they are not all the same."""
    found = {rank: call for rank, call in calls.items() if call is not None}
    if len(found) < len(calls) or len(set(found.values())) < 2:
        return None
    return found


def _error(calls: dict[int, Call], quiet_s: float) -> CollectiveMismatchError:
    lines = "\n".join(f"  rank {rank}: {call}" for rank, call in sorted(calls.items()))
    return CollectiveMismatchError(
        "the ranks wait in different collectives, so none of them can finish:\n"
        f"{lines}\n"
        f"No rank used the CPU for {quiet_s:.0f} s. Every rank must call the same "
        "collectives in the same order: look for a collective that only some ranks reach "
        "(under `if rank == ...:`, say) or a loop that runs a different number of times on "
        "different ranks. All ranks were stopped; their stacks are printed above.",
        calls={rank: str(call) for rank, call in calls.items()},
    )
