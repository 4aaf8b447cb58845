"""Every lesson's exercises: at least three, each a stub, a check and a solution, in that order,
and the committed notebook's checks say "not attempted yet".

That each solution, put in place of its stub, makes its check print "correct", that a wrong
answer makes the check raise AssertionError, and that no answer is printed above its exercise
is checked in the lesson's own kernel, right after nbval has run the lesson: the items
``exercise N``, ``exercise N rejects a wrong answer`` and ``no answer printed above the
exercises`` of ``notebooks/NN_*.ipynb`` (``tests/helpers/lesson_checks.py``). Each lesson
then runs once in the suite, not once for nbval and once more for its exercises.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from notebook_exercises import (
    Exercise,
    ExerciseFormatError,
    exercises,
    given_away,
    needed_cells,
    outputs_above,
    prompt_of,
    source,
)

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LESSONS = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
MIN_EXERCISES = 3


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


def _cell(kind: str, text: str, tags: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"cell_type": kind, "source": text, "metadata": {"tags": list(tags)}, "outputs": []}


def _printing(text: str) -> dict[str, Any]:
    cell = _cell("code", "print(...)")
    cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": text}]
    return cell


@pytest.mark.parametrize(
    ("printed", "statement", "value", "flagged"),
    [
        # What readers found: lesson 01's exercise 3 and lesson 04's exercise 3.
        ("rank 0: holds 568,352 bytes of parameters\n", "How many bytes of parameters?", 568352,
         True),
        ("backward: ...\n  most units holding full parameters at once: 3\n",
         "How many units held their full parameters at the same time at the peak of backward?",
         3, True),
        # A small number printed for something else is no give-away; neither is a larger one
        # inside another number.
        ("epoch 3: loss 2.29\n", "How many units held their full parameters at once?", 3, False),
        ("1,568,352 bytes\n", "How many bytes?", 568352, False),
        ("imbalance 1.0101\n", "What is the imbalance?", 1.0101, True),
        ("phase: backward\n", "Which phase holds the peak?", "backward", False),
    ],
)  # fmt: skip
def test_the_give_away_check(printed: str, statement: str, value: object, flagged: bool) -> None:
    cells = [_printing(printed), _cell("markdown", statement), _cell("code", "a = None")]
    exercise = Exercise(1, 2, 3, "a = None", "", "", ("a",))
    assert bool(given_away(value, outputs_above(cells, 2), prompt_of(cells, exercise))) is flagged


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
