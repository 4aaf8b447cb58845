"""A launcher killed while its ranks run (SIGKILL, the OOM killer, a forced kernel restart).

The ranks must die with it, and the ports it listened on must be free at once: a Jupyter
kernel restarted after a crash binds the same five ports again. The ranks are not children
of the test process (their parent is the killed one), so conftest's fixture cannot see them;
each test checks them by pid and kills any survivor itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.timeout(120)

TESTS = Path(__file__).parents[1] / "helpers"

# A stand-in for a kernel: it listens on five ports, then launches ranks that block.
_PARENT = textwrap.dedent(
    """
    import json, socket, sys
    sys.path.insert(0, {tests!r})
    import launch_targets
    from fsdp_guide import launch

    listening = []
    for _ in range(5):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        listening.append(sock)
    ports = [sock.getsockname()[1] for sock in listening]
    with open({ports_file!r}, "w") as f:
        json.dump(ports, f)
    launch(launch_targets.block_in_collective, 2, args=({directory!r},), backend="gloo",
           start_method={method!r}, timeout=100)
    """
)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_for_files(paths: Iterable[Path], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() and p.read_text() for p in paths):
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)


def _kill_survivors(pids: list[int]) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_ranks_die_with_a_killed_launcher_and_free_its_ports(tmp_path: Path, method: str) -> None:
    ports_file = tmp_path / "ports.json"
    script = _PARENT.format(
        tests=str(TESTS), ports_file=str(ports_file), directory=str(tmp_path), method=method
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    pid_files = [tmp_path / f"rank{r}.pid" for r in (0, 1)]
    pids: list[int] = []
    try:
        _wait_for_files([ports_file, *pid_files], 90)
        pids = [int(p.read_text()) for p in pid_files]
        ports = json.loads(ports_file.read_text())
        time.sleep(0.5)  # both ranks inside their collective
        assert all(_alive(pid) for pid in pids)
        parent.kill()
        parent.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5.0:
            if not any(_alive(pid) for pid in pids) and all(_bindable(p) for p in ports):
                break
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        assert not [pid for pid in pids if _alive(pid)], "a rank outlived its launcher"
        assert [p for p in ports if not _bindable(p)] == [], "the launcher's ports are held"
        assert elapsed < 5.0, elapsed
    finally:
        parent.kill()
        parent.wait()
        _kill_survivors(pids)


_WATCHDOG_PARENT = textwrap.dedent(
    """
    import os, time
    from fsdp_guide.launcher import _orphan

    _orphan._set_pdeathsig = lambda sig: False  # as on a platform without prctl
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        _orphan.die_with_parent(parent)
        time.sleep(60)
        os._exit(0)
    print(pid, flush=True)
    time.sleep(60)
    """
)


def test_without_prctl_a_watchdog_thread_stops_the_orphan() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG_PARENT], stdout=subprocess.PIPE, text=True
    )
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(0.3)
        assert _alive(child)
        parent.kill()
        parent.wait()
        t0 = time.monotonic()
        while _alive(child) and time.monotonic() - t0 < 5.0:
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        assert not _alive(child), "the orphan outlived its parent"
        assert elapsed < 2.0, elapsed  # the watchdog polls every 0.2 s
    finally:
        parent.kill()
        parent.wait()
        _kill_survivors([child] if child else [])
