"""The command-line entry point and its demo command."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from fsdp_guide.cli import main

pytestmark = pytest.mark.timeout(120)


def test_demo_launches_two_ranks_and_prints_their_lines() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_guide", "demo"], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for r in (0, 1):
        pattern = rf"\[rank{r}\] hello from rank {r} of 2 \(pid \d+, backend gloo\)"
        assert len([line for line in lines if re.fullmatch(pattern, line)]) == 1, lines
    assert lines[-1] == "launched 2 ranks; rank sums: [1.0, 1.0]"


@pytest.mark.parametrize("argv", [["demo", "--world-size", "0"], ["demo", "--world-size", "x"]])
def test_bad_input_exits_2_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "error:" in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize(
    "argv", [["demo", "--bogus"], ["bogus"], ["estimate", "--params"], ["compare", "--steps"]]
)
def test_argparse_errors_are_one_line_too(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("fsdp_guide") and "error:" in err[0] and "--help" in err[0]
