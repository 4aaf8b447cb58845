"""The plan: which subprocesses run the steps, with which command and time limit."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ._paths import REPO, SCRIPT

STEP_NAMES = ("pytest", "fairscale", "memory", "notebooks")
# A test module that fails to import on the GPU image must not stop the others' GPU tests.
PYTEST_ARGS = (
    "-m",
    "pytest",
    "-m",
    "gpu",
    "-q",
    "-rfEs",
    "--continue-on-collection-errors",
    "tests",
)
# Seconds each step may run; a step is also cut to what is left of --budget.
TIME_LIMITS = {"pytest": 330.0, "fairscale": 150.0, "memory": 150.0}
NOTEBOOK_LIMIT = 300.0
# A notebook's own deadline ends this much before its subprocess is killed, so that nbclient
# stops the kernel (and the ranks it forked) itself.
NOTEBOOK_GRACE = 25.0


@dataclass(frozen=True)
class Step:
    """One subprocess of the plan.

    Attributes:
        name: Shown in the report.
        argv: The command.
        limit: Seconds it may run.
        parallel: May run beside the other parallel steps (the notebooks).
    """

    name: str
    argv: tuple[str, ...]
    limit: float
    parallel: bool = False

    @property
    def command(self) -> str:
        """The command as the report shows it: ``python``, paths relative to the repo."""
        shown = ["python" if a == sys.executable else a for a in self.argv]
        return shlex.join(a.replace(f"{REPO}/", "") for a in shown)


def build_plan(
    steps: Sequence[str],
    work_dir: Path,
    notebooks: Sequence[Path],
    notebook_limit: float = NOTEBOOK_LIMIT,
) -> list[Step]:
    """The subprocesses that run ``steps``, in the order of :data:`STEP_NAMES`.

    Examples:
        >>> plan = build_plan(["memory", "pytest"], Path("/tmp/w"), [])
        >>> [(s.name, s.limit) for s in plan]
        [('pytest', 330.0), ('memory', 150.0)]
        >>> plan[0].command
        'python -m pytest -m gpu -q -rfEs --continue-on-collection-errors tests'
    """
    internal = (sys.executable, str(SCRIPT), "--internal")
    work = ("--work-dir", str(work_dir))
    deadline = ("--deadline", str(round(notebook_limit - NOTEBOOK_GRACE)))
    plan = []
    for name in (n for n in STEP_NAMES if n in steps):
        if name == "pytest":
            plan.append(Step(name, (sys.executable, *PYTEST_ARGS), TIME_LIMITS[name]))
        elif name == "notebooks":
            plan += [
                Step(
                    f"notebook {path.stem}",
                    (*internal, "notebook", "--notebook", str(path), *work, *deadline),
                    notebook_limit,
                    parallel=True,
                )
                for path in notebooks
            ]
        else:
            plan.append(Step(name, (*internal, name, *work), TIME_LIMITS[name]))
    return plan


def with_limit(step: Step, limit: float) -> Step:
    """``step`` allowed ``limit`` seconds; a ``--deadline`` in its command ends before that.

    Examples:
        >>> step = Step("nb", ("python", "x.py", "--deadline", "275"), 300.0, parallel=True)
        >>> with_limit(step, 100.0).argv
        ('python', 'x.py', '--deadline', '75')
    """
    argv = list(step.argv)
    if "--deadline" in argv[:-1]:
        argv[argv.index("--deadline") + 1] = str(max(5, round(limit - NOTEBOOK_GRACE)))
    return Step(step.name, tuple(argv), limit, step.parallel)
