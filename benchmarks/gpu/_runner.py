"""Running the plan: one process group per step, its time limit, and the whole budget."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._output import DATA_PREFIX, output_tail, parse_data, parse_summary, skips, step_status
from ._paths import REPO
from ._report import StepResult, write_json, write_markdown
from ._steps import Step, with_limit

DEFAULT_BUDGET = 520.0
MIN_STEP_SECONDS = 20.0
# Seconds of the budget a step cannot have: killing it and writing the results take time.
RESERVE_SECONDS = 5.0


def effective_limit(limit: float, remaining: float) -> float | None:
    """The limit a step gets when ``remaining`` seconds of the budget are left.

    ``None`` means there is no time to start it.

    Examples:
        >>> effective_limit(300, 1000), effective_limit(300, 100), effective_limit(300, 10)
        (300, 95.0, None)
    """
    if remaining - RESERVE_SECONDS < MIN_STEP_SECONDS:
        return None
    return min(limit, remaining - RESERVE_SECONDS)


def child_env() -> dict[str, str]:
    """This environment with the repository on ``PYTHONPATH`` and unbuffered output."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in paths:
        paths.append(str(REPO))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("MPLBACKEND", "Agg")
    env.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    return env


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill the process group the step was started in (its ranks too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_step(step: Step, limit: float, log_dir: Path, call: str) -> StepResult:
    """Run one step in a process group of its own, killed after ``limit`` seconds.

    Its whole output goes to ``log_dir/<name>.log``; the result keeps its tail.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / (re.sub(r"[^A-Za-z0-9_.-]+", "_", step.name) + ".log")
    print(f"== {step.name} (limit {limit:.0f} s): {step.command}", flush=True)
    start = time.monotonic()
    group: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {}
    with log_path.open("w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            step.argv,
            cwd=REPO,
            env=child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            **group,
        )
        timed_out = False
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc)  # past its limit, or whatever the step left running in its group
        proc.wait()
    seconds = time.monotonic() - start
    output = log_path.read_text(encoding="utf-8", errors="replace")
    counts = parse_summary(output)
    returncode = None if timed_out else proc.returncode
    status = step_status(returncode, timed_out, counts)
    shown = (
        f"{counts.passed} passed, {counts.failed} failed, {counts.skipped} skipped"
        if counts
        else ""
    )
    print(f"== {step.name}: {status} in {seconds:.1f} s {shown}", flush=True)
    kept = "\n".join(x for x in output.splitlines() if not x.startswith(DATA_PREFIX))
    return StepResult(
        name=step.name,
        command=step.command,
        limit=limit,
        status=status,
        returncode=returncode,
        seconds=seconds,
        counts=counts,
        tail=output_tail(kept) if status != "passed" else "",
        data={**parse_data(output), **skips(step.name, output)},
        call=call,
    )


@dataclass
class Runner:
    """Runs a plan within a time budget, writing the JSON and markdown after every step.

    Attributes:
        env: The environment the report names.
        start: When the budget started (``time.monotonic()``).
        budget: Seconds from ``start`` to the last step's end.
        jobs: Parallel steps (notebooks) run at once.
        call: Names this call in the report.
        work_dir: Logs go to its ``logs/``.
        json_path: This call's results, to merge.
        report: The markdown report.
        notes: Markdown for the report's Notes section, if any.
        results: The steps' results so far, in the plan's order.
    """

    env: dict[str, Any]
    start: float
    budget: float
    jobs: int
    call: str
    work_dir: Path
    json_path: Path
    report: Path
    notes: Path | None = None
    results: list[StepResult] = field(default_factory=list, init=False)
    _order: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def remaining(self) -> float:
        """Seconds of the budget left."""
        return self.budget - (time.monotonic() - self.start)

    def run_one(self, step: Step) -> StepResult:
        """Run ``step`` if the budget allows, and record its result."""
        limit = effective_limit(step.limit, self.remaining())
        if limit is None:
            result = StepResult(step.name, step.command, step.limit, "not run", call=self.call)
        else:
            step = with_limit(step, limit)
            result = run_step(step, limit, self.work_dir / "logs", self.call)
        with self._lock:
            self.results.append(result)
            self.results.sort(key=lambda r: self._order.get(r.name, len(self._order)))
            self.write()
        return result

    def run(self, plan: Sequence[Step]) -> None:
        """Serial steps one by one; the parallel ones (notebooks) ``jobs`` at a time."""
        self._order = {step.name: i for i, step in enumerate(plan)}
        for step in plan:
            if not step.parallel:
                self.run_one(step)
        parallel = [s for s in plan if s.parallel]
        if parallel:
            with ThreadPoolExecutor(max_workers=max(1, self.jobs)) as pool:
                list(pool.map(self.run_one, parallel))

    def write(self) -> None:
        """The JSON of this call and its markdown report."""
        write_json(self.json_path, self.env, self.call, self.results)
        write_markdown(self.report, self.env, self.results, self.notes)


def pack(work_dir: Path, archive: Path) -> None:
    """Logs and executed notebooks in one ``.tar.gz`` (the device returns at most 8 files)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("logs", "executed"):
            if (work_dir / name).is_dir():
                tar.add(work_dir / name, arcname=name)
