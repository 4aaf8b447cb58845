"""``python -m fsdp_guide compare``: the table, --json, --plot, progress, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_guide.cli import main
from fsdp_guide.models import build_model, count_params

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_compare_prints_table_and_writes_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path, png_path = tmp_path / "out.json", tmp_path / "out.png"
    argv = ["compare", "--world-size", "2", "--strategies", "ddp,fsdp", "--steps", "2"]
    assert main([*argv, "--json", str(json_path), "--plot", str(png_path)]) == 0
    captured = capsys.readouterr()
    assert "[1/2] ddp:" in captured.err and "[2/2] fsdp: done in" in captured.err

    table = [
        line.split() for line in captured.out.splitlines() if line.startswith(("ddp ", "fsdp "))
    ]
    assert [(cells[0], cells[2]) for cells in table] == [
        ("ddp", "0"),
        ("ddp", "1"),
        ("fsdp", "0"),
        ("fsdp", "1"),
    ]
    # Byte cells are two tokens ("3.45 MB"): the ratio is token 13, then comm/step, comm pred.
    assert {cells[13] for cells in table} == {"1.000"}  # the ratio column
    assert "comm/step  comm pred" in captured.out

    rows = json.loads(json_path.read_text())
    assert [(r["strategy"], r["rank"]) for r in rows] == [
        ("ddp", 0),
        ("ddp", 1),
        ("fsdp", 0),
        ("fsdp", 1),
    ]
    n = count_params(build_model("transformer"))
    ddp, fsdp = rows[0], rows[2]
    assert ddp["predicted"] == {
        "params": 4 * n,
        "grads": 4 * n,
        "optimizer": 8 * n,
        "buckets": 0,
        "master": 0,
        "total": 16 * n,
    }
    assert fsdp["predicted"]["total"] == 8 * n  # 16 bytes per parameter over 2 ranks
    assert ddp["measured"]["params"] == 4 * n and fsdp["measured"]["params"] == 2 * n
    for row in rows:
        assert row["world_size"] == 2 and row["peak_kind"] == "cpu_peak_rss"
        assert abs(row["ratio"] - 1) < 0.02
        assert row["step_time_s"] > 0
    assert rows[0]["loss"] == pytest.approx(rows[2]["loss"], rel=1e-5)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The per-collective breakdown of the last step (step 2 includes DDP's bucket rebuild,
    # a few int32 broadcasts, hence only the float32 all-reduce is compared here).
    assert ddp["comm"]["measured"]["kinds"]["all_reduce"]["elements"] == n
    assert ddp["comm"]["predicted"]["payload"] == {"all_reduce": n}
    assert ddp["comm"]["predicted"]["paper_elements"] == 2 * n
    assert fsdp["comm"]["measured"]["kinds"]["reduce_scatter"]["bytes"] == 4 * n
    assert fsdp["comm"]["measured"]["complete"] is True


@pytest.mark.timeout(300)
def test_compare_mlp_on_one_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "compare",
                "--world-size",
                "1",
                "--model",
                "mlp",
                "--strategies",
                "oss",
                "--steps",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("oss "))
    # One rank: OSS holds everything, 16 bytes per MLP parameter.
    assert f"{16 * count_params(build_model('mlp')) / 1e6:.2f} MB" in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategies", "ddp,zero9"], "unknown strategy 'zero9'"),
        (["--strategies", ","], "no strategy given"),
        (["--strategies", "ddp,fsdp,ddp"], "strategy 'ddp' is given twice"),
        (["--model", "resnet"], "argument --model: invalid choice: 'resnet'"),
        (["--world-size", "0"], "argument --world-size: must be an integer from 1 to 128"),
        (["--world-size", "x"], "argument --world-size: must be an integer from 1 to 128"),
        (["--steps", "0"], "argument --steps: must be an integer >= 1"),
        (["--world-size", "3"], "batch size 8 does not divide by world_size=3"),
        (["--json", "/nonexistent-dir/out.json"], "directory '/nonexistent-dir' does not exist"),
        (["--plot", "/nonexistent-dir/out.png"], "directory '/nonexistent-dir' does not exist"),
        (["--json", "."], "is a directory; give a file name"),
        (["--plot", "chart.xyz"], "matplotlib cannot write '.xyz' files"),
    ],
)
def test_bad_input_one_line_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1  # one line, and no progress: nothing was launched
    assert captured.err.startswith("fsdp_guide compare: error: ")
    assert message in captured.err


def test_cuda_only_strategy_refused_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: fairscale_fsdp is allowed here")
    assert main(["compare", "--strategies", "fairscale_fsdp"]) == 2
    assert "needs CUDA" in capsys.readouterr().err
