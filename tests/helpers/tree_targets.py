"""Launched functions that start processes of their own, for the process-tree tests.

Each rank starts the kinds of helper that real training code starts, each harder to stop
than the last, records every pid in ``directory/helpers-rank{N}.json``, then blocks in a
collective (or raises, or returns) so that the test can end the launcher the way it wants:

- ``popen``: a plain ``subprocess.Popen`` child (a compile server, a tool);
- ``ignores_term``: a child that ignores SIGTERM (a DataLoader worker slow to exit);
- ``own_session``: a child started with ``start_new_session=True`` (outside the rank's group);
- ``daemon``: a grandchild that double-forks and calls ``setsid`` (a daemonizing server),
  whose parent exits at once, so it is reparented away from the rank;
- ``worker``: a forked ``multiprocessing`` child that ignores SIGTERM (a data-loader worker).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch.distributed as dist

_IGNORE_TERM = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(300)"

# Forks, the child starts a new session and forks again, the middle process exits: the
# grandchild writes its pid and sleeps, ignoring SIGTERM and SIGHUP.
_DAEMON = textwrap.dedent(
    """
    import os, signal, sys, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            with open(sys.argv[1] + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(sys.argv[1] + ".tmp", sys.argv[1])
            time.sleep(300)
        os._exit(0)
    os.wait()
    """
)


def _slow_worker() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(300)


def start_helpers(directory: str, rank: int, with_worker: bool = True) -> dict[str, int]:
    """Start the helpers; return their pids by kind (also written to a JSON file).

    ``with_worker``: also a forked ``multiprocessing`` child that ignores SIGTERM, like a
    data-loader worker slow to exit (it holds the rank's inherited descriptors).
    """
    popen = subprocess.Popen(["sleep", "300"])
    ignores_term = subprocess.Popen([sys.executable, "-c", _IGNORE_TERM])
    own_session = subprocess.Popen(["sleep", "300"], start_new_session=True)
    daemon_file = Path(directory, f"daemon-rank{rank}.pid")
    subprocess.run([sys.executable, "-c", _DAEMON, str(daemon_file)], check=True, timeout=60)
    deadline = time.monotonic() + 60
    while not daemon_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the daemon never wrote its pid")
        time.sleep(0.01)
    pids = {
        "popen": popen.pid,
        "ignores_term": ignores_term.pid,
        "own_session": own_session.pid,
        "daemon": int(daemon_file.read_text()),
        "rank": os.getpid(),
    }
    if with_worker:
        worker = mp.get_context("fork").Process(target=_slow_worker, daemon=True)
        worker.start()
        pids["worker"] = int(worker.pid or 0)
    target = Path(directory, f"helpers-rank{rank}.json")
    target.with_suffix(".tmp").write_text(json.dumps(pids))
    target.with_suffix(".tmp").rename(target)
    return pids


def helpers_then_block(rank: int, world_size: int, directory: str) -> int:
    """Start helpers, then block: rank 0 in a barrier, the others asleep (not a mismatch)."""
    start_helpers(directory, rank)
    if rank == 0:
        dist.barrier()
    time.sleep(300)
    return rank


def helpers_then_return(rank: int, world_size: int, directory: str) -> int:
    """Start helpers and return at once, leaving them running."""
    start_helpers(directory, rank)
    return rank


def helpers_then_die(
    rank: int, world_size: int, directory: str, how: str, with_worker: bool = True
) -> int:
    """Start helpers; rank 1 then dies (``"sigkill"``, ``"raise"``); rank 0 blocks."""
    start_helpers(directory, rank, with_worker)
    dist.barrier()  # both ranks have their helpers
    if rank == 1:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(300)  # rank 0 waits here until launch stops it
    return rank
