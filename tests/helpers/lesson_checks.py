"""A pytest plugin: each lesson runs once, and its exercises are checked in the same kernel.

nbval runs every lesson top to bottom and compares the outputs of the cells tagged
``nbval-check-output``. This plugin adds items after a lesson's last cell, run in nbval's
kernel once the lesson has run there (so a lesson costs one execution, not two):

- ``exercise N``: the reference solution replaces the stub, and its check must print
  ``Exercise N: correct``;
- ``exercise N rejects a wrong answer``: after every solution, each name the reader fills in
  is replaced by a wrong value of the same kind (``notebook_exercises.WRONG_ANSWER``) and the
  check must raise ``AssertionError``;
- ``no answer printed above the exercises``: no value a solution gives is printed by an
  output above its exercise (``notebook_exercises.given_away``).

Deselecting the lesson's cells (``-k exercise``) still works: before its first exercise
runs, the kernel runs the cells the exercises read (``notebook_exercises.needed_cells``)
that nbval has not run there.

``--lesson-threads`` sets ``OMP_NUM_THREADS`` in each lesson's kernel (and so in the ranks it
spawns): ``default`` leaves the environment as it is, ``1`` runs everything on one thread
per process. Forked ranks run on one thread either way (``launch`` sets it); the option
reaches the kernel's own work and spawned ranks.

Loaded with ``-p lesson_checks`` (``pyproject.toml``'s ``addopts``; ``tests/helpers`` is on
the path).
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from nbval.plugin import IPyNbFile
from notebook_exercises import (
    REPLAY_LAUNCHES,
    WRONG_ANSWER,
    Exercise,
    exercise_uses,
    exercises,
    given_away,
    needed_cells,
    outputs_above,
    prompt_of,
)

LESSON_NAME = re.compile(r"\d\d_.*\.ipynb")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--lesson-threads",
        choices=("default", "1"),
        default="default",
        help="OMP_NUM_THREADS in each lesson's kernel: 'default' (as the environment has it) "
        "or '1'",
    )


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> Iterator[Any]:
    collected = yield
    return [
        LessonFile.from_parent(parent, path=file_path)
        if isinstance(node, IPyNbFile) and LESSON_NAME.fullmatch(file_path.name)
        else node
        for node in collected
    ]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    # What nbval ran in a lesson's kernel, so that the exercises run only what is missing.
    try:
        return (yield)
    finally:
        if isinstance(item.parent, LessonFile) and hasattr(item, "cell_num"):
            item.parent.ran.add(item.cell_num)


class KernelError(Exception):
    """Code run by an exercise item raised in the kernel."""


class LessonFile(IPyNbFile):  # type: ignore[misc]
    """nbval's collector for one lesson, with the exercise items after its cells."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ran: set[int] = set()  # nbval's code-cell numbers run in this kernel
        self.solved: dict[int, tuple[str, str]] = {}  # exercise -> (solution's, check's output)
        self.probed: dict[int, str] = {}
        self.replaying = False
        self.wrong_answers_defined = False

    def setup(self) -> None:
        threads = self.config.getoption("--lesson-threads")
        if threads == "default":
            super().setup()
            return
        before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = threads
        try:
            super().setup()  # the kernel inherits this process's environment
        finally:
            if before is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = before

    def collect(self) -> Iterator[pytest.Item]:
        yield from super().collect()
        self.cells: list[dict[str, Any]] = json.loads(self.path.read_text())["cells"]
        try:
            self.exercises = exercises(self.cells)
        except AssertionError:
            return  # tests/lessons/test_exercises.py names the format error
        for exercise in self.exercises:
            yield ExerciseItem.from_parent(self, name=f"exercise {exercise.number}", ex=exercise)
        for exercise in self.exercises:
            yield WrongAnswerItem.from_parent(
                self, name=f"exercise {exercise.number} rejects a wrong answer", ex=exercise
            )
        if self.exercises:
            yield AnswersItem.from_parent(self, name="no answer printed above the exercises")

    # -- running code in the lesson's kernel ---------------------------------------------

    def run(self, code: str) -> str:
        """Run ``code`` in the kernel; what it printed. Raises KernelError if it raised."""
        kernel = self.kernel
        if kernel is None or not kernel.is_alive():
            raise RuntimeError("the lesson's kernel is not running")
        msg_id = kernel.execute_cell_input(code, allow_stdin=False)
        timeout = float(self.config.option.nbval_cell_timeout)
        try:
            kernel.await_reply(msg_id, timeout=timeout)
        except Empty:
            kernel.interrupt()
            self.timed_out = True
        printed: list[str] = []
        error = None
        while True:
            try:
                msg = kernel.get_message("iopub", timeout=30)
            except Empty:
                raise KernelError(f"no output from the kernel after:\n{code}") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                break
            if kind == "stream":
                printed.append(content["text"])
            elif kind == "error":
                error = "\n".join(content["traceback"])
        if error is not None:
            raise KernelError(f"{''.join(printed)}\n{error}")
        return "".join(printed)

    def prepare(self) -> None:
        """Run the cells the exercises read that nbval did not run here, then the replay of
        launches (a check's launch with the same arguments as an earlier one is not run
        again: they are seeded and deterministic)."""
        if self.replaying:
            return
        if self.timed_out:
            pytest.skip("a cell of the lesson timed out: its kernel is not usable")
        code_cells = [i for i, c in enumerate(self.cells) if c["cell_type"] == "code"]
        first_stub = self.exercises[0].stub_index
        uses = set().union(*(exercise_uses(e) for e in self.exercises))
        for index in needed_cells(self.cells, uses, first_stub):
            if code_cells.index(index) not in self.ran:
                self.run(_source(self.cells[index]))
                self.ran.add(code_cells.index(index))
        self.run(REPLAY_LAUNCHES)
        self.replaying = True

    def solve(self, exercise: Exercise) -> tuple[str, str]:
        """The reference solution in place of the stub, then its check: both outputs."""
        if exercise.number not in self.solved:
            self.prepare()
            report = f"\n_report_answers({exercise.number}, {list(exercise.names)!r})\n"
            solution = self.run(exercise.solution + report)
            try:
                check = self.run(exercise.check)
            except KernelError as err:
                check = f"the check raised:\n{err}"
            self.solved[exercise.number] = (solution, check)
        return self.solved[exercise.number]

    def probe(self, exercise: Exercise) -> str:
        """Every solution first, then a wrong answer in place of this one's: the check's
        verdict."""
        if exercise.number not in self.probed:
            for each in self.exercises:
                self.solve(each)
            if not self.wrong_answers_defined:
                self.run(WRONG_ANSWER)
                self.wrong_answers_defined = True
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
            self.probed[exercise.number] = self.run(probe)
        return self.probed[exercise.number]


def _source(cell: dict[str, Any]) -> str:
    text = cell["source"]
    return "".join(text) if isinstance(text, list) else str(text)


class _LessonItem(pytest.Item):
    parent: LessonFile

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"{self.path.name}::{self.name}"

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, KernelError | AssertionError):
            return f"{self.path.name}, {self.name}:\n{excinfo.value}"
        return str(super().repr_failure(excinfo))


class ExerciseItem(_LessonItem):
    def __init__(self, *, ex: Exercise, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.exercise = ex

    def runtest(self) -> None:
        number = self.exercise.number
        _, check = self.parent.solve(self.exercise)
        # Ranks a check launches may print first; the check's own verdict comes last.
        last = check.strip().splitlines()[-1:] or [""]
        assert last[0] == f"Exercise {number}: correct", f"the solution's check printed {check!r}"


class WrongAnswerItem(ExerciseItem):
    def runtest(self) -> None:
        number = self.exercise.number
        printed = self.parent.probe(self.exercise)
        assert re.search(rf"^Exercise {number}: rejected a wrong answer", printed, re.M), printed


class AnswersItem(_LessonItem):
    """A learner reading the outputs above an exercise must not find its answer there."""

    def runtest(self) -> None:
        cells = self.parent.cells
        given = []
        for exercise in self.parent.exercises:
            solution, _ = self.parent.solve(exercise)
            found = re.search(rf"^ANSWERS {exercise.number} (.*)$", solution, re.M)
            assert found, f"exercise {exercise.number}: its solution reported no answers"
            shown = outputs_above(cells, exercise.stub_index)
            for name, value in json.loads(found[1]).items():
                for line in given_away(value, shown, prompt_of(cells, exercise)):
                    given.append(
                        f"exercise {exercise.number}: {name} = {value!r} is printed: {line!r}"
                    )
        assert given == [], given
