"""Bad command lines of ``estimate``, ``demo`` and ``compare``: one line on stderr, exit 2.

Models given with ``--model`` are the user's code: a module that raises on import, a builder
that calls ``sys.exit`` or never returns must each end in one line naming what happened,
never in a traceback, a silent exit 0 or a hang.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fsdp_guide.cli import main

MODULE = """
import sys, time

def exits_0():
    sys.exit(0)

def exits_3():
    sys.exit(3)

def spins():
    while True:
        pass

def sleeps():
    time.sleep(10**6)

def spins_in_forward():
    from fsdp_guide.models import MLP

    class Stuck(MLP):
        def forward(self, x):
            while True:
                pass
    return Stuck()

def swallows_everything():
    while True:
        try:
            time.sleep(10**6)
        except Exception:
            pass
"""


@pytest.fixture(autouse=True)
def user_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "user_builders.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "user_broken_import.py").write_text("raise ValueError('no config file')\n")
    (tmp_path / "user_exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


DIGITS = "9" * 401
CASES = {
    "module raising at import": (
        ["estimate", "--model", "user_broken_import:build"],
        "importing 'user_broken_import' raised ValueError: no config file",
    ),
    "module calling sys.exit at import": (
        ["estimate", "--model", "user_exits_on_import:build"],
        "importing 'user_exits_on_import' called sys.exit(0)",
    ),
    "layer class of a module raising at import": (
        [
            "estimate",
            "--model",
            "fsdp_guide.models:MLP",
            "--activation-checkpointing",
            "user_broken_import:Block",
        ],
        "importing 'user_broken_import' raised ValueError",
    ),
    "builder calling sys.exit(0)": (
        ["estimate", "--model", "user_builders:exits_0"],
        "the model builder user_builders:exits_0 called sys.exit(0) instead of returning a model",
    ),
    "builder calling sys.exit(3)": (
        ["estimate", "--model", "user_builders:exits_3"],
        "called sys.exit(3)",
    ),
    "builder that never returns": (
        ["estimate", "--model", "user_builders:spins", "--build-timeout", "0.5"],
        "user_builders:spins did not finish within 0.5 s",
    ),
    "builder that sleeps": (
        ["estimate", "--model", "user_builders:sleeps", "--build-timeout", "0.5"],
        "did not finish within 0.5 s",
    ),
    "builder that swallows every exception": (
        ["estimate", "--model", "user_builders:swallows_everything", "--build-timeout", "0.5"],
        "did not finish within 0.5 s",
    ),
    "forward that never returns": (
        ["estimate", "--model", "user_builders:spins_in_forward", "--build-timeout", "0.5"],
        "did not finish within 0.5 s",
    ),
    "build timeout of zero": (
        ["estimate", "--model", "fsdp_guide.models:MLP", "--build-timeout", "0"],
        "argument --build-timeout: must be a number of seconds above 0",
    ),
    "build timeout nan": (
        ["estimate", "--model", "fsdp_guide.models:MLP", "--build-timeout", "nan"],
        "argument --build-timeout: must be a number of seconds above 0",
    ),
    "world size of 401 digits": (
        ["estimate", "--params", "7B", "--world-size", DIGITS],
        "argument --world-size: must be an integer from 1 to 1048576, got '999",
    ),
    "world size of 401 digits, model": (
        ["estimate", "--model", "fsdp_guide.models:MLP", "--world-size", DIGITS],
        "argument --world-size: must be an integer from 1 to 1048576",
    ),
    "world size of 5000 digits": (
        ["estimate", "--params", "7B", "--world-size", "9" * 5000],
        "(5000 characters)",
    ),
    "batch size of 401 digits": (
        ["estimate", "--model", "fsdp_guide.models:MLP", "--batch-size", DIGITS],
        "argument --batch-size: must be an integer from 1 to 1000000000",
    ),
    "sequence length of 401 digits": (
        ["estimate", "--model", "fsdp_guide.models:TinyTransformer", "--seq-len", DIGITS],
        "argument --seq-len: must be an integer from 1 to 1000000000",
    ),
    "a parameter count past 1e15": (
        ["estimate", "--params", "1e300"],
        "argument --params: must be a positive count such as 7e9, 7B or 350M, at most 1e15",
    ),
    "demo with a world size of 401 digits": (
        ["demo", "--world-size", DIGITS],
        "argument --world-size: must be an integer from 1 to 128",
    ),
    "compare with a world size of 401 digits": (
        ["compare", "--world-size", DIGITS],
        "argument --world-size: must be an integer from 1 to 128",
    ),
    "compare with a batch of 401 digits": (
        ["compare", "--batch-size", DIGITS],
        "argument --batch-size: must be an integer from 1 to 1000000000",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv, message = CASES[case]
    started = time.monotonic()
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"fsdp_guide {argv[0]}: error: ")
    assert message in captured.err
    assert len(captured.err) < 400
    assert time.monotonic() - started < 30  # a time limit of 0.5 s, not a hang


def test_build_time_limit_leaves_the_callers_timer_running() -> None:
    import signal

    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    try:
        assert main(["estimate", "--model", "user_builders:spins", "--build-timeout", "0.2"]) == 2
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < left < 2.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_builder_exiting_from_the_entry_point(user_modules: Path) -> None:
    command = [sys.executable, "-m", "fsdp_guide", "estimate", "--model", "user_builders:exits_0"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=user_modules, check=False
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("called sys.exit(0) instead of returning a model")
    )
