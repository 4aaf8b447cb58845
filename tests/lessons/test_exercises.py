"""Every lesson's exercises: at least three, each a stub, a check and a solution, in that order;
the committed notebook's checks say "not attempted yet"; each solution, put in place of its
stub and run in a real kernel, makes its check print "correct"; and a wrong answer makes the
check raise AssertionError.

Cost: nbval already runs every lesson top to bottom with the stubs. Here each notebook is cut
down to the cells its exercises depend on (``notebook_exercises.needed_cells``: its setup cell,
and the cells defining what the solutions and checks read), so a lesson's long measurements
run only when an exercise reads their results. One kernel per notebook runs that slice, then
the solutions and their checks, then each check once more with a wrong answer; a ``launch`` of
the same function with the same arguments runs once (the pass with wrong answers gets back
what the ranks returned in the first).
"""

from __future__ import annotations

import copy
import json
import re
import textwrap
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient
from notebook_exercises import (
    Exercise,
    ExerciseFormatError,
    exercise_uses,
    exercises,
    needed_cells,
    source,
)

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LESSONS = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
MIN_EXERCISES = 3

# Runs before the solutions: the checks' launches are seeded and deterministic, so a launch of
# the same function with the same arguments (a second check, or the pass with wrong answers)
# gets the first one's results back instead of starting the ranks again.
REPLAY_LAUNCHES = textwrap.dedent(
    """
    _launched = {}
    if "launch" in globals():
        _launch_ranks = launch

        def launch(fn, *args, **kwargs):
            key = (getattr(fn, "__qualname__", repr(fn)), repr(args), repr(kwargs))
            if key not in _launched:
                _launched[key] = _launch_ranks(fn, *args, **kwargs)
            return _launched[key]
    """
)

# Replaces a reader's answer by a wrong one of the same shape (run in the kernel).
WRONG_ANSWER = textwrap.dedent(
    '''
    def _wrong_answer(value):
        """A value of the same kind as `value` that is not equal to it."""
        import torch

        if isinstance(value, bool):
            return not value
        if isinstance(value, int):
            return value + 1
        if isinstance(value, float):
            return value * 1.5 + 1.0
        if isinstance(value, str):
            return value + " (wrong)"
        if isinstance(value, torch.Tensor):
            return value + 1
        if isinstance(value, tuple | list):
            items = list(value) or ["wrong"]
            items[0] = _wrong_answer(items[0]) if value else items[0]
            return type(value)(items)
        if isinstance(value, dict):
            if not value:
                return {"wrong": 1}
            first = next(iter(value))
            return {**value, first: _wrong_answer(value[first])}
        if isinstance(value, set | frozenset):
            return type(value)(value | {"wrong"})
        if callable(value):
            def wrong(*args, **kwargs):
                return _wrong_answer(value(*args, **kwargs))
            return wrong
        raise TypeError(f"no wrong answer known for a {type(value).__name__}")
    '''
)


def _cells(notebook: str) -> list[dict[str, Any]]:
    cells: list[dict[str, Any]] = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    return cells


def _exercises(notebook: str) -> list[Exercise]:
    try:
        return exercises(_cells(notebook))
    except ExerciseFormatError as err:
        pytest.fail(f"{notebook}: {err}")


@pytest.mark.parametrize("notebook", LESSONS)
def test_every_lesson_ends_with_checked_exercises(notebook: str) -> None:
    cells = _cells(notebook)
    found = _exercises(notebook)
    assert len(found) >= MIN_EXERCISES, f"{notebook}: {len(found)} exercise(s)"
    heading = next(
        (i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
         and source(c).lstrip().startswith("## Exercises")),
        None,
    )  # fmt: skip
    assert heading is not None and heading < found[0].stub_index, "no '## Exercises' heading"
    # After the heading: exercises only (a markdown statement may precede each stub).
    parts = {i for e in found for i in (e.stub_index, e.check_index, e.check_index + 1)}
    stray = [i for i in range(heading + 1, len(cells)) if i not in parts
             and cells[i]["cell_type"] == "code"]  # fmt: skip
    assert not stray, f"code cells in the Exercises section that are not exercises: {stray}"


@pytest.mark.parametrize("notebook", LESSONS)
def test_the_committed_checks_say_not_attempted(notebook: str) -> None:
    cells = _cells(notebook)
    for exercise in _exercises(notebook):
        check = cells[exercise.check_index]
        printed = "".join(
            "".join(o.get("text", ""))
            for o in check.get("outputs", [])
            if o.get("name") == "stdout"
        )
        assert printed.strip() == f"Exercise {exercise.number}: not attempted yet", (
            f"{notebook}, exercise {exercise.number}: the stored check printed {printed!r}"
        )
        assert "nbval-check-output" in check["metadata"].get("tags", []), (
            "tag the check 'nbval-check-output' so nbval compares what it prints"
        )


def _solved_notebook(notebook: str) -> tuple[nbformat.NotebookNode, list[int]]:
    """The slice of the lesson the exercises need, then solutions, checks and wrong answers."""
    original = nbformat.reads((NOTEBOOKS / notebook).read_text(), as_version=4)
    found = _exercises(notebook)
    uses = set().union(*(exercise_uses(e) for e in found))
    keep = needed_cells(_cells(notebook), uses, found[0].stub_index)
    cells = [copy.deepcopy(original.cells[i]) for i in keep]
    for cell in cells:
        cell.outputs = []
    cells.append(nbformat.v4.new_code_cell(REPLAY_LAUNCHES))
    for exercise in found:
        cells.append(nbformat.v4.new_code_cell(exercise.solution))
        cells.append(nbformat.v4.new_code_cell(exercise.check))
    cells.append(nbformat.v4.new_code_cell(WRONG_ANSWER))
    for exercise in found:
        wrong = [f"{name} = _wrong_answer({name})" for name in exercise.names]
        probe = "\n".join(
            [
                *wrong,
                "try:",
                textwrap.indent(exercise.check, "    "),
                "except AssertionError as _error:",
                f"    print('Exercise {exercise.number}: rejected a wrong answer:', _error)",
                "else:",
                f"    print('Exercise {exercise.number}: ACCEPTED A WRONG ANSWER')",
            ]
        )
        cells.append(nbformat.v4.new_code_cell(probe))
    solved = copy.deepcopy(original)
    solved.cells = cells
    return solved, keep


def _printed(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("notebook", LESSONS)
def test_solutions_pass_their_checks_and_wrong_answers_fail(notebook: str) -> None:
    found = _exercises(notebook)
    solved, _ = _solved_notebook(notebook)
    NotebookClient(
        solved, timeout=300, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}}
    ).execute()
    checks = solved.cells[-(3 * len(found) + 1) : -(len(found) + 1)][1::2]
    probes = solved.cells[-len(found) :]
    for exercise, check, probe in zip(found, checks, probes, strict=True):
        # Ranks a check launches may print first; the check's own verdict comes last.
        last = _printed(check).strip().splitlines()[-1:] or [""]
        assert last[0] == f"Exercise {exercise.number}: correct", (
            f"{notebook}, exercise {exercise.number}: the solution's check printed "
            f"{_printed(check)!r}"
        )
        assert re.search(
            rf"^Exercise {exercise.number}: rejected a wrong answer", _printed(probe), re.M
        ), f"{notebook}, exercise {exercise.number}: {_printed(probe)!r}"


def _cell(kind: str, text: str, tags: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"cell_type": kind, "source": text, "metadata": {"tags": list(tags)}, "outputs": []}


def test_the_slice_keeps_what_the_exercises_read_and_skips_the_rest() -> None:
    cells = [
        _cell("code", "import math\nSIZE = 4"),
        _cell("code", "slow = launch(train, 2)  # a long measurement no exercise reads"),
        _cell("code", "def area(r):\n    return math.pi * r * r"),
        _cell("code", "table = {}\ntable['x'] = area(SIZE)"),
        _cell("code", "for key in table:\n    print(key)"),
        _cell("code", "table.update(y=1)"),
    ]
    assert needed_cells(cells, {"table"}, before=len(cells)) == [0, 2, 3, 5]
    assert needed_cells(cells, {"area"}, before=len(cells)) == [0, 2]


@pytest.mark.parametrize(
    ("cells", "match"),
    [
        ([_cell("code", "a = None", ("exercise",))], "needs a check and a solution"),
        (
            [
                _cell("code", "a = None", ("exercise",)),
                _cell("markdown", "<details><summary>Solution</summary>"),
                _cell("code", "print('Exercise 1: correct')", ("exercise-check",)),
            ],
            "must be tagged 'exercise-check'",
        ),
        (
            [
                _cell("code", "a = None", ("exercise",)),
                _cell("code", "print('Exercise 1: not attempted yet')", ("exercise-check",)),
                _cell("markdown", "<details><summary>Solution</summary>\n\n```python\nb = 1\n```"
                      "\n\n</details>"),
            ],
            r"does not define \['a'\]",
        ),
    ],
)  # fmt: skip
def test_malformed_exercises_are_named(cells: list[dict[str, Any]], match: str) -> None:
    with pytest.raises(ExerciseFormatError, match=match):
        exercises(cells)
