"""What each launched rank reported, and which failure caused the others (private).

The supervisor keeps one :class:`Rank` per process. A rank reports through its result pipe
(a value, a ``sys.exit`` or a traceback) or not at all (killed, ``os._exit``): then its
exit status tells what happened. The supervisor learns of the exit from a pidfd, which
a process the rank started cannot hold open (unlike the pipes the rank held). When several
ranks fail, the one that caused it is blamed, not the peers that merely lost their
connection to it.
"""

from __future__ import annotations

import pickle
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from fsdp_guide.errors import RankError
from fsdp_guide.launcher._output import _Stream

# The one message that is not a pickle (which starts with b"\x80"): the rank's pid, sent once
# its stack dumps are set up.
READY = b"ready "
# The signal that makes a rank write its stacks to the launcher alone (``_hangs.py``): a
# real-time one, which libraries and training scripts leave alone, unlike SIGUSR1/SIGUSR2.
PROBE_SIGNAL = signal.SIGRTMAX - 3
# How long to wait for the rank behind a peer's "connection reset" before stopping everyone,
# and, once a rank is known to have died (its result pipe closed without a report), for its
# exit status (longer: only a loaded machine makes this wait).
_CAUSE_WAIT_S = 0.5
_DYING_WAIT_S = 5.0


@dataclass
class Rank:
    """One launched rank as the supervisor sees it: its process, pipes and outcome."""

    rank: int
    process: BaseProcess
    result: Connection
    probe: Connection  # the rank's stack dumps for the launcher alone (``_hangs.py``)
    streams: list[_Stream] = field(default_factory=list)
    exit_fd: int | None = None  # a pidfd, readable once the rank exited (else its sentinel)
    pid: int | None = None  # the rank's pid, once it is ready (its stack dumps set up)
    closed: bool = False  # its result pipe reached end of file
    done: bool = False
    value: Any = None
    failure: RankError | None = None
    failed_at: float = 0.0


def exit_failure(rank: int, exitcode: int | None, spawned_unready: bool = False) -> RankError:
    """How a rank that sent no report ended, from its exit status.

    ``spawned_unready``: a spawned rank that never got as far as running: it failed while
    re-importing the main module, which prints its own error.
    """
    if spawned_unready and exitcode is not None and exitcode > 0:
        return RankError(
            f"rank {rank} exited with status {exitcode} before it started: a spawned rank "
            "first imports the script that called launch, and that import failed (its error "
            "is printed above). If the script calls launch at its top level, put that call "
            'under `if __name__ == "__main__":` so that the import does not run it again.',
            rank=rank,
            exitcode=exitcode,
        )
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:  # real-time signals have no name in the enum
            name = f"SIGRTMIN+{-exitcode - signal.SIGRTMIN}"
        return RankError(f"rank {rank} was killed by {name}", rank=rank, signal_name=name)
    return RankError(
        f"rank {rank} exited with status {exitcode} without returning a result",
        rank=rank,
        exitcode=exitcode,
    )


def exit_code(r: Rank) -> int | None:
    """The rank's exit code (negative: killed by that signal), once known."""
    return r.process.exitcode


def read_result(r: Rank) -> bool:
    """Read one message of the rank; ``True`` once no other will come."""
    try:
        data = r.result.recv_bytes()
    except (EOFError, OSError):
        r.closed = True
        return True  # a rank that died before reporting: its exit code tells why
    if data.startswith(READY):
        r.pid = int(data[len(READY) :])
        return False
    r.done = True
    try:
        message = pickle.loads(data)
    except Exception as exc:
        r.failure = RankError(
            f"the value returned by rank {r.rank} cannot be rebuilt in the launching process "
            f"({type(exc).__name__}: {exc}). Return plain data (numbers, strings, lists, "
            "dicts, CPU tensors), or objects of classes this process can import, not of "
            "classes defined inside the launched function or a %%distributed cell.",
            rank=r.rank,
        )
        r.failed_at = time.time()
        return False
    if message[0] == "ok":
        r.value = message[1]
    elif message[0] == "exit":
        _, code, argument, failed_at = message
        called = f"rank {r.rank} called sys.exit({argument})"
        if code == 0:
            text = f"{called} before returning a result"
        elif argument == repr(code):
            text = called
        else:
            text = f"{called}: exit status {code}"
        r.failure = RankError(text, rank=r.rank, exitcode=code)
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
    return False  # end of file follows


def read_pending(r: Rank) -> None:
    """Read what the rank already sent, without waiting."""
    while not r.closed and r.result.poll() and not read_result(r):
        pass


def on_exit(r: Rank) -> None:
    """Record how an exited rank ended: its report if it sent one, else its exit status."""
    read_pending(r)
    code = exit_code(r)
    if code is not None and r.failure is None and (not r.done or code != 0):
        r.done = True
        spawned_unready = r.pid is None and type(r.process).__name__ == "SpawnProcess"
        r.failure = exit_failure(r.rank, code, spawned_unready)
        r.failed_at = time.time()


def wait_for_the_cause(ranks: list[Rank]) -> None:
    """Before stopping the ranks, note those that already died on their own.

    A rank that dies without a report (killed, ``os._exit``) breaks its peers' connections;
    a peer's "connection reset" report can arrive before the death is noticed. When every
    failure so far is such a report, wait briefly for the rank that caused it.
    """
    start = time.monotonic()
    while True:
        for r in ranks:
            if r.failure is None:
                on_exit(r)
        failures = [r.failure for r in ranks if r.failure is not None]
        if not all(lost_a_peer(f) for f in failures):
            return
        # A rank whose result pipe closed without a report died; how, its exit code says.
        dying = any(r.closed and not r.done for r in ranks)
        if time.monotonic() - start >= (_DYING_WAIT_S if dying else _CAUSE_WAIT_S):
            return
        time.sleep(0.02)


# What a rank's collective raises when a peer went away: a consequence, never the cause.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def lost_a_peer(failure: RankError) -> bool:
    text = (failure.remote_traceback or "").strip()
    last = text.splitlines()[-1] if text else ""
    return any(marker in last for marker in _PEER_LOST)


def root_cause(ranks: list[Rank]) -> RankError:
    """The failure that caused the others.

    Peers that merely lost their connection to a failed rank are passed over. A rank that
    died without a report (killed, ``os._exit``) is only noticed after its peers may already
    have reported the lost connection, so report times alone would blame a peer.
    """
    failed = [(r.failure, r.failed_at) for r in ranks if r.failure is not None]
    failure, _ = min(failed, key=lambda pair: (lost_a_peer(pair[0]), pair[1]))
    return failure
