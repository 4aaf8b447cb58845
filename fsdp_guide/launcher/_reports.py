"""What each launched rank reported, and which failure caused the others (private).

The supervisor keeps one :class:`Rank` per process. A rank reports through its result pipe
(a value, a ``sys.exit`` or a traceback) or not at all (killed, ``os._exit``): then its
exit status tells what happened. When several ranks fail, the one that caused it is
blamed, not the peers that merely lost their connection to it.
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

# What a rank sends, followed by its pid, once its stack dumps are set up.
READY = b"ready "
# How long to wait for the rank behind a peer's "connection reset" before stopping everyone,
# and, once a rank is known to have died (its result pipe closed without a report), for its
# guard to pass on how it died (longer: only a loaded machine makes this wait).
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
    pid: int | None = None  # the rank's own pid, once it is ready (below its guard)
    hung_up: bool = False  # its result pipe closed without a report: it died
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


def read_result(r: Rank) -> bool:
    """Read one message of the rank; ``True`` once no other will come."""
    try:
        data = r.result.recv_bytes()
    except (EOFError, OSError):
        r.hung_up = True
        return True  # died before reporting; the exit status tells why
    if data.startswith(READY):  # not a pickle, which starts with b"\x80"
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
        return True
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
    return True


def read_pending(r: Rank) -> None:
    """Read what the rank already sent, up to its final message, without waiting."""
    while not r.done and r.result.poll() and not read_result(r):
        pass


def on_exit(r: Rank) -> None:
    """Record how an exited rank ended: its report if it sent one, else its exit status."""
    read_pending(r)
    if r.failure is None and (not r.done or r.process.exitcode != 0):
        r.done = True
        spawned_unready = r.pid is None and type(r.process).__name__ == "SpawnProcess"
        r.failure = exit_failure(r.rank, r.process.exitcode, spawned_unready)
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
            if r.failure is not None:
                continue
            if r.process.exitcode is not None:
                on_exit(r)
            elif not r.done:
                read_pending(r)  # notices a rank that died (``hung_up``)
        failures = [r.failure for r in ranks if r.failure is not None]
        if not all(lost_a_peer(f) for f in failures):
            return
        dying = any(r.hung_up and r.failure is None for r in ranks)
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
