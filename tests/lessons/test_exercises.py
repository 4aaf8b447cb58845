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
import functools
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
    given_away,
    needed_cells,
    outputs_above,
    prompt_of,
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


    def _report_answers(number, names):
        # What a solution gave its names, when it is a number or a short string.
        import json

        shown = {}
        for name in names:
            value = globals().get(name)
            if isinstance(value, int | float | str) and not isinstance(value, bool):
                if not isinstance(value, str) or len(value) <= 40:
                    shown[name] = value
        print(f"ANSWERS {number} " + json.dumps(shown))
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
        report = f"\n_report_answers({exercise.number}, {list(exercise.names)!r})\n"
        cells.append(nbformat.v4.new_code_cell(exercise.solution + report))
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


@functools.cache
def _executed(notebook: str) -> nbformat.NotebookNode:
    """The solved slice of the lesson, run once in a kernel (both tests below read it)."""
    solved, _ = _solved_notebook(notebook)
    NotebookClient(
        solved, timeout=300, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}}
    ).execute()
    return solved


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("notebook", LESSONS)
def test_solutions_pass_their_checks_and_wrong_answers_fail(notebook: str) -> None:
    found = _exercises(notebook)
    solved = _executed(notebook)
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


def _answers(solution: nbformat.NotebookNode, number: int) -> dict[str, Any]:
    """What the solution of exercise ``number`` gave its names (numbers, short strings)."""
    found = re.search(rf"^ANSWERS {number} (.*)$", _printed(solution), re.M)
    assert found, f"exercise {number}: its solution reported no answers"
    return dict(json.loads(found[1]))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("notebook", LESSONS)
def test_no_answer_is_printed_above_its_exercise(notebook: str) -> None:
    """A learner who reads an outputs above the exercise must not find the answer there."""
    found = _exercises(notebook)
    cells = _cells(notebook)
    solutions = _executed(notebook).cells[-(3 * len(found) + 1) : -(len(found) + 1)][0::2]
    given = []
    for exercise, solution in zip(found, solutions, strict=True):
        shown = outputs_above(cells, exercise.stub_index)
        for name, value in _answers(solution, exercise.number).items():
            for line in given_away(value, shown, prompt_of(cells, exercise)):
                given.append(f"exercise {exercise.number}: {name} = {value!r} is printed: {line!r}")
    assert given == []


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
