"""A launcher killed before its ranks armed their parent-death signal.

A rank runs some code before it can ask Linux for a parent-death signal (a spawned rank
starts its interpreter; in a forked rank, the ``os.register_at_fork`` handlers of the
libraries loaded run first); a launcher killed in that window sends none. Each rank must
still notice that its launcher is gone (its parent pid changed) and end itself, with
everything below it, before running anything. Forked ranks are the case where nothing
else would stop them: they hold the read ends of each other's pipes, so their writes do
not fail. The launcher here loads a handler that sleeps after each fork; the test kills
it while both ranks sleep there, then looks for any process carrying a token from the
launcher's environment (they are orphans, not the test's children).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

TESTS = Path(__file__).parents[1] / "helpers"

_LAUNCHER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import launch_targets
    from fsdp_guide import launch

    os.register_at_fork(after_in_child=lambda: time.sleep(1.0))
    launch(launch_targets.block_in_collective, 2, args=({directory!r},),
           backend="gloo", start_method="fork", timeout=100)
    """
)


def _carrying(token: str) -> list[int]:
    """Pids of this user's live processes whose environment holds ``token``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if (
                proc.status() != psutil.STATUS_ZOMBIE
                and proc.environ().get("FSDP_GUIDE_T") == token
            ):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue


def test_ranks_whose_launcher_died_before_they_armed_their_signal_end(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER.format(tests=str(TESTS), directory=str(tmp_path)))
    launcher = subprocess.Popen(
        [sys.executable, str(script)], env={**os.environ, "FSDP_GUIDE_T": token}
    )
    try:
        proc = psutil.Process(launcher.pid)
        deadline = time.monotonic() + 60
        while len(proc.children()) < 2:
            assert time.monotonic() < deadline, "the ranks never started"
            assert launcher.poll() is None, "the launcher ended on its own"
            time.sleep(0.01)
        launcher.kill()
        launcher.wait()
        assert not list(tmp_path.glob("rank*.pid")), "a rank ran before the launcher was killed"
        left = _carrying(token)
        deadline = time.monotonic() + 10
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = _carrying(token)
        assert left == [], f"{len(left)} processes outlived the launcher killed early"
        assert not list(tmp_path.glob("rank*.pid")), "an orphaned rank ran the user's function"
    finally:
        launcher.kill()
        launcher.wait()
        _signal_all(_carrying(token), signal.SIGKILL)
