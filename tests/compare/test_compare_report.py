"""The report helpers: tables, JSON rows and the bar chart."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fsdp_guide.catalog import check_strategies
from fsdp_guide.compare import (
    ComparisonRow,
    comparison_table,
    plot_comparison,
    rows_as_json,
    text_table,
)
from fsdp_guide.memory import ModelState, predict_model_state


def _rows() -> list[ComparisonRow]:
    predicted = predict_model_state("fsdp", 1000, 2)
    return [
        ComparisonRow(
            strategy="fsdp",
            rank=rank,
            world_size=2,
            zero_stage=3,
            measured=ModelState(params=2000, grads=2000, optimizer=4004 + rank),
            predicted=predicted,
            step_time_s=0.01,
        )
        for rank in range(2)
    ]


@pytest.mark.parametrize("style", ["markdown", "plain"])
def test_table_has_a_line_per_row(style: str) -> None:
    text = comparison_table(_rows(), style=style)  # type: ignore[arg-type]
    lines = text.splitlines()
    assert len(lines) == (4 if style == "markdown" else 3)
    assert "1.000" in lines[-2] and "1.001" in lines[-1]  # 8004 and 8005 over 8000
    assert lines[-1].split()[:3] == (
        ["|", "fsdp", "|"] if style == "markdown" else ["fsdp", "3", "1"]
    )


@pytest.mark.parametrize("style", ["markdown", "plain"])
@pytest.mark.parametrize(
    ("times", "cells"),
    [((None, None), None), ((0.01, None), ["10.0", "-"]), ((0.0125, 0.002), ["12.5", "2.0"])],
)
def test_time_column_only_when_timed(
    style: str, times: tuple[float | None, float | None], cells: list[str] | None
) -> None:
    rows = [replace(row, step_time_s=t) for row, t in zip(_rows(), times, strict=True)]
    lines = comparison_table(rows, style=style).splitlines()  # type: ignore[arg-type]
    header = lines[0].replace("|", " ").split()
    last_cells = [line.replace("|", " ").split()[-1] for line in lines[-2:]]
    if cells is None:
        assert "ms/step" not in header
        assert last_cells == ["1.000", "1.001"]
    else:
        assert header[-1] == "ms/step"
        assert last_cells == cells


def test_table_rejects_unknown_style() -> None:
    with pytest.raises(ValueError, match="unknown style 'html'"):
        comparison_table(_rows(), style="html")  # type: ignore[arg-type]


def test_rows_as_json_round_trip() -> None:
    data = json.loads(json.dumps(rows_as_json(_rows())))
    assert data[1]["measured"]["total"] == 2000 + 2000 + 4005
    assert data[1]["predicted"]["total"] == 8000
    assert data[1]["ratio"] == pytest.approx(8005 / 8000)


def test_plot_writes_png(tmp_path: Path) -> None:
    path = tmp_path / "memory.png"
    fig = plot_comparison(_rows(), path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    ax = fig.axes[0]
    assert len(ax.patches) == 4 * len(_rows())  # 3 stacked measured bars + 1 predicted each


@pytest.mark.parametrize(
    "measured",
    [ModelState(4, 4, 8, buckets=4), ModelState(4, 4, 8, master=4), ModelState(4, 4, 8)],
)
def test_a_measured_bar_is_as_tall_as_the_tables_measured_column(measured: ModelState) -> None:
    row = ComparisonRow(strategy="ddp", rank=0, world_size=2, zero_stage=0, measured=measured,
                        predicted=ModelState(4, 4, 8))  # fmt: skip
    ax = plot_comparison([row]).axes[0]
    stacked = [p for p in ax.patches if p.get_x() < -0.1]  # the measured bar: left of 0
    assert sum(p.get_height() for p in stacked) == pytest.approx(measured.total / 1e6)
    assert f"{measured.total} B" in comparison_table([row])


@pytest.mark.parametrize(
    ("name", "world_size", "grads"),
    [
        ("sharded_ddp", 4, 1000),
        ("sharded_ddp_buckets", 4, 4000),
        ("fsdp_grad_op", 4, 1000),
        ("fsdp_hybrid", 4, 2000),
    ],
)
def test_predictions_model_the_state_at_the_step(name: str, world_size: int, grads: int) -> None:
    assert predict_model_state(name, 1000, world_size).grads == grads


def test_check_strategies_refuses_empty() -> None:
    with pytest.raises(ValueError, match="no strategy given"):
        check_strategies([])


@pytest.mark.parametrize("style", ["markdown", "plain"])
def test_text_table_refuses_a_row_of_another_length(style: str) -> None:
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        text_table([["a", "b"], ["1"]], style)  # type: ignore[arg-type]


def test_text_table_aligns_columns_and_strips_trailing_space() -> None:
    lines = text_table([["strategy", "x"], ["ddp", "12345"], ["fsdp2", ""]]).splitlines()
    assert lines == ["strategy  x", "ddp       12345", "fsdp2"]
