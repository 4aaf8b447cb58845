"""Nothing a rank starts outlives the launch, however the launch or the rank ends.

Each rank starts four helpers (``tree_targets``): a plain child, one that ignores SIGTERM,
one in a session of its own, and a daemon that double-forks out of the rank's process
tree. The helpers are not children of the test process once their parents die, so the
conftest fixture cannot see them: each test finds them by pid and kills any survivor.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
import pytest
import tree_targets

from fsdp_guide import RankError, launch

pytestmark = pytest.mark.timeout(180)

HELPERS = Path(__file__).parents[1] / "helpers"
# The bound within which every process below the ranks must be gone.
GONE_WITHIN_S = 5.0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _helper_pids(directory: Path) -> dict[str, int]:
    pids: dict[str, int] = {}
    for path in sorted(directory.glob("helpers-rank*.json")):
        rank = path.stem.removeprefix("helpers-")
        pids.update({f"{rank}.{kind}": pid for kind, pid in json.loads(path.read_text()).items()})
    return pids


def _survivors(pids: dict[str, int], within_s: float) -> dict[str, int]:
    deadline = time.monotonic() + within_s
    while (alive := {k: p for k, p in pids.items() if _alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _wait_for_helpers(directory: Path, ranks: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while len(list(directory.glob("helpers-rank*.json"))) < ranks:
        assert time.monotonic() < deadline, "the ranks never started their helpers"
        time.sleep(0.05)


_LAUNCHING_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {helpers!r})
    import tree_targets
    from fsdp_guide import launch

    if __name__ == "__main__":
        launch(tree_targets.helpers_then_block, 2, args=({directory!r},), backend="gloo",
               start_method={method!r}, timeout=150)
    """
)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_nothing_below_the_ranks_survives_a_sigkilled_launching_script(
    tmp_path: Path, method: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        _LAUNCHING_SCRIPT.format(helpers=str(HELPERS), directory=str(tmp_path), method=method)
    )
    parent = subprocess.Popen([sys.executable, str(script)])
    below: dict[str, int] = {}
    try:
        _wait_for_helpers(tmp_path, 2, 120)
        # Every descendant: the ranks, helpers, the daemon, their own
        # children, and the launcher's multiprocessing helpers.
        launcher = psutil.Process(parent.pid)
        below = _helper_pids(tmp_path)
        below.update({f"pid{p.pid}": p.pid for p in launcher.children(recursive=True)})
        assert len(set(below.values())) >= 2 * 6, below  # 2 ranks x (rank + 5 helpers)
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        left = _survivors(below, GONE_WITHIN_S)
        assert left == {}, f"alive {GONE_WITHIN_S:g} s after the launcher was killed: {left}"
    finally:
        parent.kill()
        parent.wait(30)
        _kill(below.values())


@pytest.mark.parametrize("how", ["sigkill", "raise"])
def test_a_failing_rank_leaves_nothing_it_started(tmp_path: Path, how: str) -> None:
    # The forked worker holds the rank's pipes and sentinel: a killed rank used to go
    # unnoticed until the timeout. Its pidfd tells the launcher at once.
    t0 = time.monotonic()
    try:
        with pytest.raises(RankError, match="killed by SIGKILL" if how == "sigkill" else "raise"):
            launch(
                tree_targets.helpers_then_die,
                2,
                args=(str(tmp_path), how),
                backend="gloo",
                start_method="fork",
                timeout=120,
            )
        assert time.monotonic() - t0 < 60
        pids = _helper_pids(tmp_path)
        assert len(pids) == 2 * 6
        # launch returned: the processes below the ranks are gone already, or die now.
        assert _survivors(pids, 1.0) == {}
    finally:
        _kill(_helper_pids(tmp_path).values())


def test_the_launcher_ends_what_a_killed_rank_left_and_nothing_of_its_own(
    tmp_path: Path,
) -> None:
    # A rank killed outright hands its processes to the launcher, a child subreaper while
    # ranks run; the launcher's own children, even in a session of their own, are not
    # touched, and it is no subreaper once launch has returned.
    from fsdp_guide.launcher import _tree

    own = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        with pytest.raises(RankError, match="killed by SIGKILL"):
            launch(
                tree_targets.helpers_then_die,
                2,
                args=(str(tmp_path), "sigkill"),
                backend="gloo",
                start_method="fork",
                timeout=120,
            )
        rank1 = {k: p for k, p in _helper_pids(tmp_path).items() if k.startswith("rank1.")}
        assert len(rank1) == 6 and _survivors(rank1, 1.0) == {}
        assert own.poll() is None, "launch ended a process it did not start"
        assert not _tree._is_subreaper()
    finally:
        own.kill()
        own.wait()
        _kill(_helper_pids(tmp_path).values())


def test_a_rank_that_returns_leaves_nothing_it_started(tmp_path: Path) -> None:
    try:
        assert launch(
            tree_targets.helpers_then_return,
            2,
            args=(str(tmp_path),),
            backend="gloo",
            start_method="fork",
            timeout=120,
        ) == [0, 1]
        pids = _helper_pids(tmp_path)
        assert len(pids) == 2 * 6
        assert _survivors(pids, 1.0) == {}
    finally:
        _kill(_helper_pids(tmp_path).values())


def test_a_rank_killed_by_a_signal_is_reported_with_it() -> None:
    import launch_targets

    with pytest.raises(RankError, match="rank 1 was killed by SIGTERM"):
        launch(
            launch_targets.kill_self_with,
            2,
            args=(1, signal.SIGTERM),
            backend="gloo",
            start_method="fork",
            timeout=60,
        )


def test_without_a_subreaper_the_rank_leads_its_group_and_failures_still_stop_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Off Linux (no child subreaper): launching, results and failures behave the same, and
    # what stays in the group of a rank that exited is stopped with the others. (No forked
    # worker here: off Linux, holding the rank's descriptors, it would hide the rank's exit
    # until the timeout; on Linux the rank's pidfd tells it at once.)
    from fsdp_guide.launcher import _tree

    monkeypatch.setattr(_tree, "prctl", lambda option, value: False)
    import launch_targets

    assert launch(launch_targets.times_ten, 2, backend="gloo", start_method="fork") == [0, 10]
    try:
        with pytest.raises(RankError, match="rank 1 raised RuntimeError"):
            launch(
                tree_targets.helpers_then_die,
                2,
                args=(str(tmp_path), "raise", False),
                backend="gloo",
                start_method="fork",
                timeout=120,
            )
        pids = _helper_pids(tmp_path)
        stay = ("popen", "ignores_term")  # the helpers that stay in the rank's group
        in_group = {k: p for k, p in pids.items() if k.split(".")[1] in stay}
        assert len(in_group) == 4 and _survivors(in_group, 1.0) == {}
    finally:
        _kill(_helper_pids(tmp_path).values())
