"""The launcher's contract, including the failure matrix of torch's multiprocessing tests.

Every failure test asserts the error type, the rank or exit status in it, an upper bound on
the elapsed time, and (through the autouse fixture in conftest) that no process is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import launch_targets as targets
import pytest
import torch

import fsdp_guide
from fsdp_guide import RankError, launch
from fsdp_guide.errors import LaunchError, LaunchTimeout

METHODS = ["fork", "spawn"]
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("start_method", METHODS)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_runs_on_every_rank_and_returns_in_rank_order(world_size: int, start_method: str) -> None:
    results = launch(
        targets.world_info,
        world_size=world_size,
        args=("t",),
        kwargs={"scale": 2},
        backend="gloo",
        start_method=start_method,  # type: ignore[arg-type]
    )
    assert [r["rank"] for r in results] == list(range(world_size))
    expected_sum = 2.0 * sum(range(world_size))
    for r in results:
        assert r["world_size"] == r["dist_world"] == world_size
        assert r["dist_rank"] == r["rank"]
        assert r["backend"] == "gloo"
        assert r["rank_sum"] == expected_sum
        assert r["tag"] == "t"
    assert len({r["pid"] for r in results}) == world_size
    assert os.getpid() not in {r["pid"] for r in results}


def test_auto_backend_is_gloo_without_gpus() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: auto would pick nccl")
    assert launch(targets.world_info, 2, start_method="fork")[0]["backend"] == "gloo"


def test_master_port_from_environment_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    port = fsdp_guide.find_free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    # Twice: the first run leaves the port in TIME_WAIT, which must not count as "in use".
    for _ in range(2):
        seen = launch(targets.master_port_seen, 2, backend="gloo", start_method="fork")
        assert seen == [port, port]


@pytest.mark.parametrize("start_method", METHODS)
def test_return_values_of_several_megabytes_come_back_intact(start_method: str) -> None:
    numel = 2_000_000  # 8 MB of float32 plus 2 MB of bytes per rank
    results = launch(
        targets.big_result,
        2,
        args=(numel,),
        backend="gloo",
        start_method=start_method,  # type: ignore[arg-type]
    )
    for rank, (tensor, blob) in enumerate(results):
        expected, _ = targets.big_result(rank, 2, numel)
        assert torch.equal(tensor, expected)
        assert blob == bytes([rank]) * numel


def test_output_is_prefixed_whole_lines_never_mixed(capfd: pytest.CaptureFixture[str]) -> None:
    lines, width = 200, 300
    launch(targets.chatter, 2, args=(lines, width), backend="gloo", start_method="fork")
    out, err = capfd.readouterr()
    out_lines = [line for line in out.splitlines() if line.startswith("[rank")]
    for rank in (0, 1):
        mine = [line for line in out_lines if line.startswith(f"[rank{rank}] ")]
        body = [f"rank{rank}-line{i}-" + "x" * width for i in range(lines)]
        assert mine == [f"[rank{rank}] {b}" for b in body] + [
            f"[rank{rank}] rank{rank} no newline at the end"
        ]
    err_lines = [line for line in err.splitlines() if line.startswith("[rank")]
    for rank in (0, 1):
        assert [line for line in err_lines if line.startswith(f"[rank{rank}] err")] == [
            f"[rank{rank}] err rank{rank} line{i}" for i in range(lines)
        ]
    assert not re.search(r"\[rank\d\] [^\n]*\[rank\d\]", out)


@pytest.mark.parametrize("start_method", METHODS)
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_raising_rank_gives_rank_error_with_its_traceback(
    start_method: str, bad_rank: int
) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(
            targets.raise_on,
            2,
            args=(bad_rank,),
            backend="gloo",
            start_method=start_method,  # type: ignore[arg-type]
        )
    assert time.monotonic() - t0 < 30
    err = info.value
    assert isinstance(err, LaunchError)
    assert err.rank == bad_rank
    assert f"ValueError: boom from rank {bad_rank}" in str(err)
    assert "Traceback (most recent call last)" in str(err)
    assert "launch_targets.py" in str(err) and "raise_on" in str(err)
    assert err.remote_traceback is not None and err.exitcode is None


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_failure_while_peers_wait_in_a_collective_is_reported_fast(bad_rank: int) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        # The collective's own timeout is 300 s; the error must come long before it.
        launch(
            targets.fail_while_peers_wait,
            3,
            args=(bad_rank,),
            backend="gloo",
            start_method="fork",
            timeout=300,
        )
    elapsed = time.monotonic() - t0
    assert elapsed < 10, elapsed
    assert info.value.rank == bad_rank
    assert f"rank {bad_rank} gave up" in str(info.value)


@pytest.mark.parametrize("start_method", METHODS)
def test_a_rank_exiting_non_zero_reports_its_exit_status(start_method: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 exited with status 3") as info:
        launch(targets.exit_with, 2, args=(1, 3), backend="gloo", start_method=start_method)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 1 and info.value.exitcode == 3 and info.value.signal_name is None


def test_sys_exit_in_a_rank_reports_its_status() -> None:
    with pytest.raises(RankError, match=r"rank 0 called sys.exit\(5\)") as info:
        launch(targets.sys_exit_with, 2, args=(0, 5), backend="gloo", start_method="fork")
    assert info.value.exitcode == 5


@pytest.mark.parametrize("start_method", METHODS)
def test_a_rank_killed_by_a_signal_names_the_signal(start_method: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 1 was killed by SIGKILL") as info:
        launch(targets.kill_self, 2, args=(1,), backend="gloo", start_method=start_method)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 1 and info.value.signal_name == "SIGKILL"


def test_timeout_names_the_ranks_still_running_and_stops_them() -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout, match=r"ranks \[1\] still running after 2 s") as info:
        launch(
            targets.sleep_on, 2, args=(1, 120.0), backend="gloo", start_method="fork", timeout=2.0
        )
    assert 2.0 <= time.monotonic() - t0 < 10
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, LaunchError)
    assert info.value.ranks == [1]


def test_keyboard_interrupt_stops_all_ranks_and_is_reraised() -> None:
    def interrupt(signum: int, frame: types.FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(targets.sleep_all, 2, args=(120.0,), backend="gloo", start_method="fork")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - t0 < 10


def test_unpicklable_return_value_is_a_rank_error() -> None:
    with pytest.raises(RankError, match="could not be pickled; return plain data"):
        launch(targets.unpicklable_result, 2, backend="gloo", start_method="fork")


# --- bad input: raised before any process starts ---------------------------------------


@pytest.fixture
def no_process_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started before the input was checked")

    monkeypatch.setattr(fsdp_guide.launcher._supervisor, "start_ranks", refuse)


@pytest.mark.usefixtures("no_process_may_start")
@pytest.mark.parametrize("world_size", [0, -1, 1.5, "2", True, None])
def test_bad_world_size(world_size: object) -> None:
    with pytest.raises(ValueError, match="world_size must be"):
        launch(targets.world_info, world_size)  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_process_may_start")
@pytest.mark.parametrize("backend", ["mpi", "NCCL", ""])
def test_unknown_backend_lists_the_valid_ones(backend: str) -> None:
    with pytest.raises(ValueError, match="choose one of 'auto', 'gloo', 'nccl'"):
        launch(targets.world_info, 2, backend=backend)  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_process_may_start")
def test_nccl_with_too_few_gpus_names_both_counts() -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    want = gpus + 1
    with pytest.raises(ValueError, match=rf"world_size={want} but {gpus} GPU\(s\) visible"):
        launch(targets.world_info, want, backend="nccl")


@pytest.mark.usefixtures("no_process_may_start")
@pytest.mark.parametrize(
    "bad",
    [
        {"start_method": "forkserver"},
        {"timeout": 0},
        {"timeout": -3},
        {"timeout": float("nan")},
        {"timeout": float("inf")},
        {"timeout": True},
        {"timeout": "60"},
    ],
)
def test_bad_start_method_or_timeout(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="start_method|timeout"):
        launch(targets.world_info, 2, **bad)  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_process_may_start")
@pytest.mark.parametrize(
    ("call", "match"),
    [
        ({"fn": 42}, r"pass the function itself, launch\(train, ...\)"),
        ({"args": 3}, r"args must be a tuple.*write args=\(3,\) with the trailing comma"),
        ({"args": "cfg.yaml"}, r"args=\('cfg.yaml',\)"),
        ({"kwargs": [("scale", 2)]}, "kwargs must be a dict"),
    ],
)
def test_bad_fn_args_or_kwargs_name_the_fix(call: dict[str, Any], match: str) -> None:
    options = {"fn": targets.world_info, "world_size": 2, "backend": "gloo", **call}
    with pytest.raises(TypeError, match=match):
        launch(**options)


@pytest.mark.usefixtures("no_process_may_start")
@pytest.mark.parametrize("value", ["abc", "0", "70000"])
def test_master_port_that_is_not_a_port(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MASTER_PORT", value)
    with pytest.raises(ValueError, match="is not a TCP port number.*unset it"):
        launch(targets.world_info, 2, backend="gloo")


@pytest.mark.usefixtures("no_process_may_start")
def test_master_port_in_use_says_unset_it(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(ValueError, match=rf"MASTER_PORT={port} cannot be used.*Unset"):
            launch(targets.world_info, 2, backend="gloo")


@pytest.mark.usefixtures("no_process_may_start")
def test_fork_with_cuda_initialised_says_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is already initialised.*Restart the kernel"):
        launch(targets.world_info, 2, start_method="fork")


NOTEBOOK_CODE = """
import torch
from fsdp_guide import launch

SCALE = 3.0  # a global of the "notebook", sent along with the function


class Doubler(torch.nn.Module):  # a class defined in the notebook
    def forward(self, x):
        return 2 * x


def train(rank, world_size, base):
    return float(Doubler()(torch.tensor(base + rank)) * SCALE)


if __name__ == "__main__":
    print(launch(train, 2, args=(1.0,), backend="gloo", start_method="{method}"))
"""


@pytest.mark.parametrize("method", ["spawn", "auto"])
def test_spawn_runs_functions_and_classes_defined_in_a_notebook(method: str) -> None:
    # ``python -c`` has a kernel's unnamed __main__ (no __file__); "auto" spawns without a
    # terminal prompt, as it does in a notebook on a machine with a GPU.
    code = NOTEBOOK_CODE.replace("{method}", method)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[6.0, 12.0]"


@pytest.mark.usefixtures("no_process_may_start")
def test_spawn_refuses_unpicklable_arguments() -> None:
    with pytest.raises(TypeError, match="must pickle the function and its arguments.*_thread.lock"):
        launch(targets.world_info, 2, args=(threading.Lock(),), start_method="spawn")


def test_auto_start_method_forks_in_an_interactive_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    from fsdp_guide.launcher import _checks

    assert _checks.resolve_start_method("auto") == "fork"
    # With a GPU visible a backward pass here would leave forked ranks unable to run one.
    monkeypatch.setattr(_checks, "_gpu_count", lambda: 1)
    assert _checks.resolve_start_method("auto") == "spawn"
    monkeypatch.setattr(_checks, "_gpu_count", lambda: 0)
    monkeypatch.delattr(sys, "ps1")
    assert _checks.resolve_start_method("auto") == "spawn"


# --- torchrun: the same function, one process per rank started by torchrun -------------

TORCHRUN_SCRIPT = """
import json, os, sys, time
from pathlib import Path
from fsdp_guide import launch
sys.path.insert(0, {tests!r})
import launch_targets
rank = int(os.environ["RANK"])
summaries = []
for tag in ("torchrun", "again"):
    results = launch(launch_targets.world_info, world_size=2, args=(tag,), timeout=20)
    summaries.append([{{k: r[k] for k in ("rank", "rank_sum", "tag")}} for r in results])
    # Rank 0 late: the group the next launch makes must not read this one's addresses.
    time.sleep(1.5 * (rank == 0))
# One file per rank: the ranks share torchrun's stdout, where their lines can interleave.
Path({out!r}, f"rank{{rank}}.json").write_text(json.dumps(summaries))
launch(launch_targets.raise_on, args=(1,), timeout=20)  # rank 1 raises: fail, not hang
"""


def test_under_torchrun_runs_in_process_and_every_rank_gets_all_results(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        TORCHRUN_SCRIPT.format(tests=str(Path(__file__).parents[1] / "helpers"), out=str(tmp_path))
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    port = fsdp_guide.find_free_port()
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={port}",
            "--master-addr=127.0.0.1",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    expected = [
        [{"rank": r, "rank_sum": 1.0, "tag": tag} for r in (0, 1)] for tag in ("torchrun", "again")
    ]
    for rank in (0, 1):
        written = tmp_path / f"rank{rank}.json"
        assert written.exists(), proc.stderr[-4000:]
        assert json.loads(written.read_text()) == expected, proc.stderr
    # The second launch fails on rank 1: the run fails instead of hanging (it used to hang
    # about one time in two: the failing rank blocked in destroy_process_group). Which
    # rank's traceback torchrun shows is a race: it stops the others when one exits.
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 60


def test_under_torchrun_an_exception_propagates_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    # A one-rank torchrun environment, in this process: launch must not wrap the error in a
    # RankError (torchrun, not launch, supervises the ranks), and must leave no group behind.
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(fsdp_guide.find_free_port())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        with pytest.raises(ValueError, match="boom from rank 0"):
            launch(targets.raise_on, world_size=2, args=(0,), backend="gloo")
        # Left up after a failure (see launch's docstring); a later call reuses it.
        assert torch.distributed.is_initialized()
        assert launch(targets.world_info, args=("again",), backend="gloo")[0]["tag"] == "again"
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert launch(targets.world_info, args=("fresh",), backend="gloo")[0]["tag"] == "fresh"
    assert not torch.distributed.is_initialized()  # a group launch created is destroyed


def test_dist_init_rejects_a_bad_rank() -> None:
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\)"):
        fsdp_guide.launcher.dist_init(2, 2)


@pytest.mark.parametrize("world_size", [1, 2])
def test_fork_after_the_parent_used_torch_threads_does_not_hang(world_size: int) -> None:
    # A notebook builds models before launching: the parent's OpenMP pool is then live, and
    # a forked rank running a parallel region on several threads would deadlock.
    torch.set_num_threads(2)
    big = torch.zeros(10**7)
    big.add_(1)
    results = launch(
        targets.matmul_checksum, world_size, backend="gloo", start_method="fork", timeout=60
    )
    expected = [targets.matmul_checksum(r, world_size) for r in range(world_size)]
    # Ranks use fewer threads than the parent, so sums are reordered: compare with a tolerance.
    assert results == pytest.approx(expected, rel=1e-5)


def test_timeout_prints_where_each_running_rank_is_stuck(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(LaunchTimeout, match="their stacks at that moment are printed above"):
        launch(targets.stuck_in_all_reduce, 2, backend="gloo", start_method="fork", timeout=3.0)
    err = capfd.readouterr().err
    # faulthandler's dump, relayed line by line with each rank's prefix.
    for rank, frame in ((0, "stuck_in_all_reduce"), (1, "all_reduce")):
        lines = [line for line in err.splitlines() if line.startswith(f"[rank{rank}] ")]
        assert any("most recent call first" in line for line in lines), err[-2000:]
        assert any(frame in line for line in lines), err[-2000:]


@pytest.mark.parametrize("start_method", METHODS)
def test_rendezvous_port_is_bound_by_us_not_probed(
    monkeypatch: pytest.MonkeyPatch, start_method: str
) -> None:
    # Probing a free port and binding it later leaves a window for another process to take
    # it; the launcher binds the port itself and hands the listening socket to rank 0.
    monkeypatch.delenv("MASTER_PORT", raising=False)

    def no_probe(*args: object, **kwargs: object) -> int:
        raise AssertionError("launch probed for a free port")

    monkeypatch.setattr(sys.modules["fsdp_guide.launcher._rendezvous"], "find_free_port", no_probe)
    results = launch(targets.world_info, 2, backend="gloo", start_method=start_method)  # type: ignore[arg-type]
    assert [r["rank_sum"] for r in results] == [1.0, 1.0]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_garbage_of_the_function_is_freed_on_the_main_thread_before_the_group_goes(
    tmp_path: Path, start_method: str
) -> None:
    # A DDP reducer left in a reference cycle holds the process group. Freed later by a
    # collection that runs on gloo's thread (a Python comm-hook callback allocating), it can
    # destroy the group there, and the group's destructor joins that very thread: SIGABRT,
    # "Resource deadlock avoided". The launcher collects first, on the main thread.
    launch(
        targets.leave_cyclic_garbage,
        2,
        args=(str(tmp_path),),
        backend="gloo",
        start_method=start_method,
        timeout=60,
    )
    for rank in range(2):
        assert (tmp_path / f"rank{rank}").read_text() == "main, group"


def test_a_forked_child_here_can_train() -> None:
    from fsdp_guide.launcher._checks import _forked_child_works

    assert _forked_child_works()


@pytest.mark.usefixtures("no_process_may_start")
def test_fork_is_refused_once_a_forked_child_could_not_train(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a GPU machine looks like after a backward pass in the kernel.
    from fsdp_guide.launcher import _checks

    monkeypatch.setattr(_checks, "_gpu_count", lambda: 1)
    monkeypatch.setattr(_checks, "_forked_child_works", lambda: False)
    with pytest.raises(RuntimeError, match="backward pass.*start_method='spawn'"):
        launch(targets.world_info, 2, start_method="fork")


def _visible_devices(rank: int, world_size: int) -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_gloo_rank_sees_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert launch(_visible_devices, 2, backend="gloo", start_method="fork") == ["", ""]


SCRIPT = """
import threading

from fsdp_guide import launch

LOCK = threading.Lock()  # a global no pickle can carry: the spawned rank makes its own


def train(rank, world_size):
    with LOCK:
        return rank


if __name__ == "__main__":
    print(launch(train, 2, backend="gloo", start_method="spawn"))
"""


def test_a_script_s_function_is_sent_by_name(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[0, 1]"
