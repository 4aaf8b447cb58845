"""Measure how ``fsdp_guide.launch`` ends under faults: processes left, seconds to error, fds.

Each row is one fault, measured the way a user meets it:

- processes left 5 s after a launching script is killed with SIGKILL, each rank having
  started a plain child, a child ignoring SIGTERM, a child in its own session, a daemon
  that double-forks away, and a forked worker (fork and spawn ranks);
- processes left 1 s after ``launch`` returned, when a rank returned, raised or was killed
  with helpers running (and how long the launch took);
- seconds until ``launch`` raises when the ranks call collectives in a different order, and
  when a nested ``launch`` runs on rank 0 only while rank 1 is busy;
- open descriptors after 50 failing launches in one process;
- seconds and the last line of the error for a spawned launch from a script without
  ``if __name__ == "__main__":``.

Usage::

    python benchmarks/launch_faults.py [--timeout 60]

Run it with ``PYTHONPATH`` pointing at another checkout's package to compare versions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

HELPERS = Path(__file__).resolve().parents[1] / "tests" / "helpers"
sys.path.insert(0, str(HELPERS))

import collective_targets  # noqa: E402
import launch_targets  # noqa: E402
import tree_targets  # noqa: E402

from fsdp_guide import launch  # noqa: E402


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _helper_pids(directory: Path) -> list[int]:
    pids: list[int] = []
    for path in directory.glob("helpers-rank*.json"):
        pids += list(json.loads(path.read_text()).values())
    return pids


def _left_after(pids: list[int], seconds: float) -> list[int]:
    time.sleep(seconds)
    left = [p for p in set(pids) if _alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def killed_script(method: str) -> str:
    directory = Path(tempfile.mkdtemp())
    script = directory / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(HELPERS)!r})
            import tree_targets
            from fsdp_guide import launch
            if __name__ == "__main__":
                launch(tree_targets.helpers_then_block, 2, args=({str(directory)!r},),
                       backend="gloo", start_method={method!r}, timeout=200)
            """
        )
    )
    parent = subprocess.Popen([sys.executable, str(script)])
    while len(_helper_pids(directory)) < 12:
        time.sleep(0.05)
    time.sleep(0.5)
    below = _helper_pids(directory) + [c.pid for c in psutil.Process(parent.pid).children(True)]
    parent.kill()
    parent.wait()
    left = _left_after(below, 5.0)
    return f"{len(left)} of {len(set(below))} alive 5 s later"


def rank_ends(how: str) -> str:
    directory = Path(tempfile.mkdtemp())
    args: tuple[object, ...] = (str(directory),) if how == "return" else (str(directory), how)
    fn = tree_targets.helpers_then_return if how == "return" else tree_targets.helpers_then_die
    t0 = time.monotonic()
    try:
        launch(fn, 2, args=args, backend="gloo", start_method="fork", timeout=120)
        outcome = "returned"
    except Exception as exc:
        outcome = type(exc).__name__
    elapsed = time.monotonic() - t0
    pids = _helper_pids(directory)
    left = _left_after(pids, 1.0)
    return f"{outcome} in {elapsed:.1f} s; {len(left)} of {len(set(pids))} alive 1 s later"


def seconds_to_error(fn: object, args: tuple[object, ...], timeout: float) -> str:
    t0 = time.monotonic()
    try:
        launch(fn, 2, args=args, backend="gloo", start_method="fork", timeout=timeout)  # type: ignore[arg-type]
        return "no error"
    except Exception as exc:
        kind = type(exc).__name__
        first = str(exc).splitlines()[0][:90]
        return f"{time.monotonic() - t0:.1f} s: {kind}: {first}"


def fds_after_failures(count: int) -> str:
    def fail() -> None:
        with contextlib.suppress(Exception):
            launch(launch_targets.raise_on, 2, args=(1,), backend="gloo", start_method="fork")

    fail()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(count):
        fail()
    return f"{before} -> {len(os.listdir('/proc/self/fd'))} open descriptors"


def unguarded_script() -> str:
    directory = Path(tempfile.mkdtemp())
    script = directory / "train.py"
    script.write_text(
        "from fsdp_guide import launch\nfrom fsdp_guide._examples import rank_and_sum\n\n"
        "print(launch(rank_and_sum, 2, backend='gloo'))\n"
    )
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "(no error)"
    return f"{time.monotonic() - t0:.1f} s: {last[:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=60.0, help="launch timeout, seconds")
    args = parser.parse_args()
    rows = [
        ("launching script SIGKILLed, fork ranks", lambda: killed_script("fork")),
        ("launching script SIGKILLed, spawn ranks", lambda: killed_script("spawn")),
        ("rank returns, helpers running", lambda: rank_ends("return")),
        ("rank raises, helpers running", lambda: rank_ends("raise")),
        ("rank SIGKILLed, helpers running", lambda: rank_ends("sigkill")),
        (
            "collectives in a different order",
            lambda: seconds_to_error(collective_targets.swapped_order, (), args.timeout),
        ),
        (
            "nested launch on rank 0 only, rank 1 busy",
            lambda: seconds_to_error(
                collective_targets.launch_on_rank_zero_only, (args.timeout * 2,), args.timeout
            ),
        ),
        ("50 failing launches in one process", lambda: fds_after_failures(50)),
        ("spawn from a script without the __main__ guard", unguarded_script),
    ]
    import fsdp_guide

    print(f"fsdp_guide from {Path(fsdp_guide.__file__).parent}, launch timeout {args.timeout:g} s")
    for name, measure in rows:
        print(f"| {name} | {measure()} |", flush=True)


if __name__ == "__main__":
    main()
