"""benchmarks/gpu_validation.py on a machine without CUDA: what it selects, runs and reports.

Not ``gpu``-marked: it checks the script itself, on the CPU, with lessons made here (one
passes with a CUDA-only cell that must be skipped without a GPU, one fails).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_validation.py"


def _notebook(path: Path, cells: list[tuple[str, list[str]]]) -> str:
    notebook = nbformat.v4.new_notebook()  # type: ignore[no-untyped-call]
    for source, tags in cells:
        cell = nbformat.v4.new_code_cell(source)  # type: ignore[no-untyped-call]
        cell.metadata["tags"] = tags
        notebook.cells.append(cell)
    nbformat.write(notebook, str(path))  # type: ignore[no-untyped-call]
    return str(path)


def _run(*args: str) -> tuple[int, dict[str, dict[str, str]], str]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    out = Path(args[args.index("--out") + 1])
    report = json.loads((out / "gpu_validation.json").read_text())
    results = {r["name"]: r for r in report["results"]}
    return done.returncode, results, (out / "gpu_validation.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without CUDA")
@pytest.mark.timeout(300)
def test_script_runs_gpu_tests_only_and_lessons_without_their_cuda_cells(tmp_path: Path) -> None:
    good = _notebook(
        tmp_path / "good.ipynb",
        [
            ("x = 1", []),
            ("raise RuntimeError('CUDA only')", ["skip-execution", "nbval-skip"]),
            ("print(x + 1)", []),
        ],
    )
    bad = _notebook(tmp_path / "bad.ipynb", [("raise ValueError('a broken lesson')", [])])
    tests = ["tests/gpu/test_peak_memory_gpu.py", "tests/package/test_models.py"]
    code, results, markdown = _run(
        "--tests", *tests, "--notebook", good, "--notebook", bad, "--out", str(tmp_path / "out")
    )
    assert code == 1  # the broken lesson
    pytest_run = results["pytest -m gpu"]
    # -m gpu: the three CUDA tests collected and skipped here, the CPU module's deselected.
    assert pytest_run["status"] == "passed"
    assert "3 skipped" in pytest_run["summary"] and "deselected" in pytest_run["summary"]
    assert "passed" not in pytest_run["summary"]
    assert results["good.ipynb"]["status"] == "passed"
    assert "1 tagged skip-execution (skipped)" in results["good.ipynb"]["summary"]
    executed = nbformat.read(str(tmp_path / "out" / "executed" / "good.ipynb"), as_version=4)  # type: ignore[no-untyped-call]
    assert executed.cells[2].outputs[0]["text"] == "2\n"
    assert executed.cells[1].outputs == []
    assert results["bad.ipynb"]["status"] == "failed"
    assert "a broken lesson" in results["bad.ipynb"]["tail"]
    assert "no CUDA device visible" in markdown and "## bad.ipynb: failed" in markdown


@pytest.mark.timeout(120)
def test_nothing_starts_once_the_budget_is_spent(tmp_path: Path) -> None:
    lesson = _notebook(tmp_path / "lesson.ipynb", [("print(1)", [])])
    code, results, _ = _run("--budget", "0", "--notebook", lesson, "--out", str(tmp_path / "out"))
    assert code == 1
    assert [r["status"] for r in results.values()] == ["not run", "not run"]
