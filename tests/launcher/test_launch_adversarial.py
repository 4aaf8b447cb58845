"""Ways a rank can misbehave beyond raising: leftovers, odd output, odd exits, interrupts.

Each case once broke the launcher (wrong error type, a process left behind, a hang until the
timeout, unbounded buffering); each test asserts the error or result, the elapsed time, and
(through the autouse fixture in conftest) that no child process is left.
"""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import launch_targets as targets
import psutil
import pytest

from fsdp_guide import RankError, launch
from fsdp_guide.errors import LaunchTimeout
from fsdp_guide.launcher import _output, _reports, _stop, _supervisor

pytestmark = pytest.mark.timeout(120)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_processes_a_rank_leaves_running_are_stopped_at_once(tmp_path: Path) -> None:
    # Orphaned grandchildren are not our descendants, so conftest's fixture cannot see them.
    t0 = time.monotonic()
    results = launch(
        targets.leave_a_process_running,
        2,
        args=(str(tmp_path),),
        backend="gloo",
        start_method="fork",
    )
    elapsed = time.monotonic() - t0
    assert results == [0, 1]
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 2.0
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(p) for p in pids), "a process started by a rank survived launch"
    # They held the ranks' stdout pipes open; launch must not wait for them to let go.
    assert elapsed < 1.9, elapsed


def test_a_rank_alive_after_sending_its_result_is_stopped(
    capfd: pytest.CaptureFixture[str],
) -> None:
    t0 = time.monotonic()
    results = launch(
        targets.linger_after_result,
        2,
        args=(60.0,),
        backend="gloo",
        start_method="fork",
        timeout=30,
    )
    elapsed = time.monotonic() - t0
    assert results == [0, 1]
    assert elapsed < _supervisor._EXIT_GRACE_S + 5, elapsed  # the grace, not the 30 s timeout
    assert "ranks [0, 1] sent their results but were still running" in capfd.readouterr().err


def test_huge_lines_are_cut_and_bad_bytes_replaced(capfd: pytest.CaptureFixture[str]) -> None:
    cap = _output._MAX_LINE_CHARS
    long_chars = 8 * cap + 5
    t0 = time.monotonic()
    launch(targets.write_awkward_output, 2, args=(long_chars,), backend="gloo", start_method="fork")
    assert time.monotonic() - t0 < 10
    lines = capfd.readouterr().out.splitlines()
    rank0 = [line.removeprefix("[rank0] ") for line in lines if line.startswith("[rank0] ")]
    assert rank0 == ["a" * cap] * 8 + ["aaaaa", "end"]
    rank1 = [line for line in lines if line.startswith("[rank1] ")]
    assert rank1 == ["[rank1] euro \N{EURO SIGN} and a bad \N{REPLACEMENT CHARACTER} byte"]


def test_a_large_result_while_a_peer_floods_its_output(capfd: pytest.CaptureFixture[str]) -> None:
    numel, lines = 32 * 2**20, 50_000
    t0 = time.monotonic()
    big, peer = launch(
        targets.big_result_while_peer_prints,
        2,
        args=(numel, lines),
        backend="gloo",
        start_method="fork",
        timeout=60,
    )
    assert time.monotonic() - t0 < 30
    assert big.numel() == numel and int(big.min()) == int(big.max()) == 7 and peer == 1
    printed = [line for line in capfd.readouterr().out.splitlines() if line.startswith("[rank1]")]
    assert len(printed) == lines and printed[-1] == f"[rank1] rank 1 line {lines - 1}"


def test_a_rank_killed_by_a_real_time_signal_is_a_rank_error() -> None:
    signum = signal.SIGRTMIN + 6
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 was killed by SIGRTMIN\+6") as info:
        launch(targets.kill_self_with, 2, args=(1, signum), backend="gloo", start_method="fork")
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 1 and info.value.signal_name == "SIGRTMIN+6"


@pytest.mark.parametrize(
    ("argument", "message", "exitcode"),
    [
        (None, r"rank 1 called sys.exit\(\) before returning a result$", 0),
        (4, r"rank 1 called sys.exit\(4\)$", 4),
        ("lr must be > 0", r"rank 1 called sys.exit\('lr must be > 0'\): exit status 1$", 1),
    ],
)
def test_sys_exit_reports_its_argument(argument: object, message: str, exitcode: int) -> None:
    with pytest.raises(RankError, match=message) as info:
        launch(targets.sys_exit_with, 2, args=(1, argument), backend="gloo", start_method="fork")
    assert info.value.rank == 1 and info.value.exitcode == exitcode


def _failed_rank(rank: int, failure: RankError, failed_at: float) -> Any:
    r = _reports.Rank(rank=rank, process=None, result=None, probe=None)  # type: ignore[arg-type]
    r.failure, r.failed_at = failure, failed_at
    return r


def test_root_cause_is_the_rank_that_died_not_the_peer_that_lost_it() -> None:
    # The peer's report was sent before the launcher noticed the silent death.
    peer_text = (
        "Traceback (most recent call last):\n  ...\nRuntimeError: [pair.cc:537] Read error "
        "[127.0.0.1]:1234: Connection reset by peer. This is typically caused by ...\n"
    )
    peer = RankError("rank 0 raised RuntimeError", rank=0, remote_traceback=peer_text)
    died = RankError("rank 1 exited with status 3", rank=1, exitcode=3)
    ranks = [_failed_rank(0, peer, 100.0), _failed_rank(1, died, 100.2)]
    assert _reports.root_cause(ranks) is died
    # Between two genuine errors, the earlier one wins.
    own = RankError("rank 0 raised ValueError", rank=0, remote_traceback="ValueError: x\n")
    assert _reports.root_cause([_failed_rank(0, own, 100.0), ranks[1]]) is own


class _DiedSilently:
    exitcode = -signal.SIGKILL


class _StillRunning:
    exitcode = None


class _NoReport:
    def poll(self) -> bool:
        return False


def test_a_peer_reporting_first_does_not_hide_the_rank_that_died() -> None:
    # The peer's report is read before the dead rank's exit was noticed: the launcher must
    # look for ranks that already died before it stops everyone (and so kills them itself).
    peer_text = "RuntimeError: [pair.cc:537] Read error: Connection reset by peer.\n"
    peer = RankError("rank 0 raised RuntimeError", rank=0, remote_traceback=peer_text)
    dead = _reports.Rank(rank=1, process=_DiedSilently(), result=_NoReport(), probe=None)  # type: ignore[arg-type]
    ranks = [_failed_rank(0, peer, 100.0), dead]
    _reports.wait_for_the_cause(ranks)
    cause = _reports.root_cause(ranks)
    assert cause.rank == 1 and cause.signal_name == "SIGKILL"
    # With nobody else dead the wait is short, and the peer's report is all there is.
    alive = _reports.Rank(rank=1, process=_StillRunning(), result=_NoReport(), probe=None)  # type: ignore[arg-type]
    t0 = time.monotonic()
    _reports.wait_for_the_cause([ranks[0], alive])
    assert time.monotonic() - t0 < _reports._CAUSE_WAIT_S + 0.5
    assert alive.failure is None


@pytest.mark.parametrize(
    ("target", "args", "message"),
    [
        (targets.exit_with, (1, 3), "rank 1 exited with status 3"),
        (targets.kill_self, (1,), "rank 1 was killed by SIGKILL"),
    ],
)
def test_a_rank_dying_is_blamed_not_its_peer_every_time(
    target: Any, args: tuple[int, ...], message: str
) -> None:
    for _ in range(8):  # each used to name rank 0's lost connection now and then
        with pytest.raises(RankError, match=message) as info:
            launch(target, 2, args=args, backend="gloo", start_method="fork")
        assert info.value.rank == 1


def test_a_rank_ignoring_sigterm_is_killed_at_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout, match=r"ranks \[0, 1\] still running"):
        launch(
            targets.ignore_sigterm_and_sleep,
            2,
            args=(120.0,),
            backend="gloo",
            start_method="fork",
            timeout=1.0,
        )
    # timeout + the SIGTERM grace, then SIGKILL
    assert time.monotonic() - t0 < 1.0 + _stop.TERMINATE_GRACE_S + 5


def test_pressing_stop_twice_still_kills_a_rank_that_ignores_sigterm() -> None:
    interrupts = 0

    def interrupt(signum: int, frame: types.FrameType | None) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts <= 2:  # the second lands while the launcher waits for SIGTERM to work
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0, 0.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(
                targets.ignore_sigterm_and_sleep,
                2,
                args=(120.0,),
                backend="gloo",
                start_method="fork",
            )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupts >= 2
    assert time.monotonic() - t0 < 10
    # conftest's fixture fails the test if a rank is still running


@pytest.mark.parametrize(
    ("kind", "shown"),
    [
        ("unpicklable", "ShardLost: shard 3 is gone"),
        ("keyboard", "KeyboardInterrupt"),  # the rank's, not the user's: no KeyboardInterrupt here
        ("unprintable", "Unprintable: <exception str() failed>"),
    ],
)
def test_odd_exceptions_in_a_rank_arrive_as_text(kind: str, shown: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(targets.raise_odd, 2, args=(kind,), backend="gloo", start_method="fork")
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 1 and shown in str(info.value)
    assert "raise_odd" in (info.value.remote_traceback or "")


def test_a_spawned_rank_that_cannot_import_the_function_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It used to die while unpickling, before its output was captured: the caller got only
    # "exited with status 1" and the reason went to the terminal (or nowhere, in a notebook).
    module = targets.a_module_only_the_launcher_has()
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(RankError, match="could not rebuild the function or its arguments") as info:
        launch(module.train, 2, backend="gloo", start_method="spawn", timeout=60)
    assert "No module named 'module_of_the_launcher_only'" in str(info.value)
    assert "start_method='fork'" in str(info.value)


def test_a_value_that_cannot_be_unpickled_here_is_a_rank_error() -> None:
    with pytest.raises(RankError, match="cannot be rebuilt in the launching process") as info:
        launch(targets.return_a_child_only_class, 2, backend="gloo", start_method="fork")
    assert "module_of_the_rank_only" in str(info.value)
    assert "Return plain data" in str(info.value)


def test_launch_errors_survive_pickling() -> None:
    rank_error = RankError("rank 1 was killed", rank=1, exitcode=None, signal_name="SIGKILL")
    copy = pickle.loads(pickle.dumps(rank_error))
    assert type(copy) is RankError and str(copy) == "rank 1 was killed"
    assert (copy.rank, copy.exitcode, copy.signal_name) == (1, None, "SIGKILL")
    timeout = LaunchTimeout("ranks [0] still running", ranks=[0], timeout=2.0)
    copy_t = pickle.loads(pickle.dumps(timeout))
    assert isinstance(copy_t, TimeoutError) and (copy_t.ranks, copy_t.timeout) == ([0], 2.0)


def test_launch_inside_a_launched_rank_runs_in_process_on_its_group() -> None:
    results = launch(targets.launch_inside_a_rank, 2, backend="gloo", start_method="fork")
    assert results == [[0, 10], [0, 10]]


CONCURRENT_LAUNCHES = """
import json, sys, threading
sys.path.insert(0, {tests!r})
import launch_targets as targets
from fsdp_guide import launch

results = {{}}

def run(tag):
    got = launch(targets.world_info, 2, args=(f"t{{tag}}",), backend="gloo", start_method="fork")
    results[tag] = [[r["tag"], r["rank_sum"]] for r in got]

threads = [threading.Thread(target=run, args=(tag,)) for tag in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
print(json.dumps(results, sort_keys=True))
"""


def test_launches_from_several_threads_at_once_each_get_their_own_results() -> None:
    # In a fresh interpreter: in this long-lived pytest process, after hundreds of earlier
    # fork launches and torch workloads, forking from several threads at once has crashed
    # the child inside os.fork() itself (SIGSEGV in the after-fork handlers, not in our
    # code). launch's docstring advises one launching thread at a time.
    script = CONCURRENT_LAUNCHES.format(tests=str(Path(__file__).parents[1] / "helpers"))
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results == {str(tag): [[f"t{tag}", 1.0], [f"t{tag}", 1.0]] for tag in range(3)}
