"""``python -m fsdp_guide estimate``: output, what fits, bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fsdp_guide.cli import main


def _stage_lines(out: str) -> dict[str, list[str]]:
    lines = [line.split() for line in out.splitlines()]
    return {cells[0]: cells for cells in lines if cells and cells[0] in ("0", "1", "2", "3")}


def test_zero_paper_figure_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7.5e9", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "7.50B parameters on 64 ranks, mixed precision, adam: 2 + 2 + 12" in out
    totals = {stage: cells[-2] for stage, cells in _stage_lines(out).items()}
    assert totals == {"0": "120.00", "1": "31.41", "2": "16.64", "3": "1.88"}


@pytest.mark.parametrize(
    ("memory", "fits"),
    [
        ("80GB", ["no", "yes", "yes", "yes"]),
        ("20GB", ["no", "no", "no", "yes"]),
        ("200GiB", ["yes", "yes", "yes", "yes"]),
    ],
)
def test_gpu_memory_tells_what_fits(
    memory: str, fits: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", "--params", "7B", "--world-size", "8", "--gpu-memory", memory]) == 0
    lines = _stage_lines(capsys.readouterr().out)
    assert [lines[s][-1] for s in "0123"] == fits


def test_small_figures_print_in_a_unit_that_shows_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 1M parameters on 8 ranks: a GB column printed 0.00 GB for every sharded cell.
    assert main(["estimate", "--params", "1M", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1.00M parameters on 8 ranks")
    assert _stage_lines(out)["3"][-8:] == [
        "250.00",
        "KB",
        "250.00",
        "KB",
        "1.50",
        "MB",
        "2.00",
        "MB",
    ]
    assert "0.00 GB" not in out and "0.01 GB" not in out


def test_fp32_sgd(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--params", "1e9", "--world-size", "4", "--precision", "fp32"]
    assert main([*args, "--optimizer", "sgd_momentum"]) == 0
    lines = _stage_lines(capsys.readouterr().out)
    # 4 + 4 + 4 bytes per parameter: 12 GB unsharded, 3 GB fully sharded.
    assert lines["0"][-2:] == ["12.00", "GB"]
    assert lines["3"][-2:] == ["3.00", "GB"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "one of the arguments --params --model --hf is required"),
        (["--params", "0"], "argument --params: must be a positive count"),
        (["--params=-7e9"], "argument --params: must be a positive count"),
        (["--params", "lots"], "argument --params: must be a positive count"),
        (["--params", "1e400"], "argument --params: must be a positive count"),
        (["--params", "1e-9"], "argument --params: must be a positive count"),
        (["--params", "7e9", "--gpu-memory", "1e400GB"], "size '1e400GB' is too large"),
        (
            ["--params", "7e9", "--world-size", "0"],
            "argument --world-size: must be an integer from 1 to 1048576",
        ),
        (
            ["--params", "7e9", "--world-size", "two"],
            "argument --world-size: must be an integer from 1 to 1048576",
        ),
        (["--params", "7e9", "--gpu-memory", "big"], "cannot read 'big' as a size"),
        (["--params", "7e9", "--gpu-memory", "0GB"], "argument --gpu-memory: must be positive"),
        # A bare number used to be read as bytes, so nothing fitted; now it needs its unit.
        (["--params", "7e9", "--gpu-memory", "80"], "'80' has no unit; write e.g. 80GB"),
        (["--params", "7e9", "--gpu-memory", "8e10"], "'8e10' has no unit"),
        (["--params", "7e9", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
        (
            ["--params", "7e9", "--optimizer", "lamb"],
            "argument --optimizer: invalid choice: 'lamb'",
        ),
    ],
)
def test_bad_input_one_line_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("fsdp_guide estimate: error: ")
    assert message in captured.err


def test_module_entry_point_exit_status() -> None:
    cmd = [sys.executable, "-m", "fsdp_guide", "estimate", "--params", "nope"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "fsdp_guide estimate: error: argument --params: must be a positive count such as 7e9, "
        "7B or 350M, at most 1e15, got 'nope' (see: fsdp_guide estimate --help)"
    ]
