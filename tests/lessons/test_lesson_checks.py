"""The exercise items ``lesson_checks`` adds after a lesson's cells fail when they should.

A four-cell lesson with three exercises runs through pytest with the plugin: one solution is
right, one is wrong, one check accepts any answer and its answer is printed above it. Each
item must pass or fail accordingly, in one kernel that ran the lesson first.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def _check(number: int, name: str, condition: str) -> str:
    return (
        f"if {name} is None:\n"
        f"    print('Exercise {number}: not attempted yet')\n"
        "else:\n"
        f"    assert {condition}, 'not yet: try again'\n"
        f"    print('Exercise {number}: correct')"
    )


def _exercise(number: int, name: str, condition: str, solution: str) -> list[nbformat.NotebookNode]:
    new = nbformat.v4
    return [
        new.new_markdown_cell(f"Exercise {number}: what is `{name}`?"),
        new.new_code_cell(f"{name} = None", metadata={"tags": ["exercise"]}),
        new.new_code_cell(_check(number, name, condition), metadata={"tags": ["exercise-check"]}),
        new.new_markdown_cell(
            f"<details><summary>Solution</summary>\n\n```python\n{solution}\n```\n\n</details>"
        ),
    ]


def lesson() -> nbformat.NotebookNode:
    new = nbformat.v4
    shown = new.new_code_cell("print('pi to four places:', round(math.pi, 4))", execution_count=1)
    shown.outputs = [new.new_output("stream", name="stdout", text="pi to four places: 3.1416\n")]
    cells = [
        new.new_code_cell("import math\nRADIUS = 2"),
        shown,  # its stored output gives exercise 3's answer away
        new.new_markdown_cell("## Exercises"),
        *_exercise(1, "area", "abs(area - math.pi * RADIUS**2) < 1e-9", "area = math.pi * 4"),
        *_exercise(2, "side", "side == 4", "side = 5"),  # a wrong reference solution
        *_exercise(3, "pi4", "True", "pi4 = round(math.pi, 4)"),  # accepts anything; shown above
    ]
    notebook = new.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    return notebook


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_exercise_item_passes_or_fails_as_it_should(tmp_path: Path) -> None:
    path = tmp_path / "01_tiny.ipynb"
    nbformat.write(lesson(), path)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", path.name, "-p", "lesson_checks", "--nbval-lax",
         "-p", "no:cacheprovider", "-rA", "-q"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(HELPERS)},
    )  # fmt: skip
    outcomes = dict(
        (name.strip(), outcome)
        for outcome, name in re.findall(r"^(PASSED|FAILED) 01_tiny\.ipynb::([^\n]*?)(?: - .*)?$",
                                        done.stdout, re.M)
    )  # fmt: skip
    assert outcomes == {
        **{f"Cell {i}": "PASSED" for i in range(8)},
        "exercise 1": "PASSED",
        "exercise 2": "FAILED",
        "exercise 3": "PASSED",
        "exercise 1 rejects a wrong answer": "PASSED",
        "exercise 2 rejects a wrong answer": "PASSED",
        "exercise 3 rejects a wrong answer": "FAILED",
        "no answer printed above the exercises": "FAILED",
    }, done.stdout[-4000:]
    assert "pi4 = 3.1416 is printed: 'pi to four places: 3.1416'" in done.stdout
