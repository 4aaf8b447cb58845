"""How long the tests take: wall time, CPU time and the 30 slowest test phases.

Three ways to run it, from the repository root; each rewrites its own part of
``benchmarks/results/test_time.md`` and keeps the others:

    python benchmarks/test_time.py            # the README's test command, every test
    python3 benchmarks/test_time.py --ci      # all of `bash .ci/run` (it makes its own .venv:
                                              # run it from a Python outside that venv)
    python benchmarks/test_time.py --before REV --part NAME -- PYTEST_ARGS...

The third runs ``python -m pytest PYTEST_ARGS`` twice with this environment's Python: in a
scratch checkout of ``REV`` (the tests and the package as they were) and in this one, and
adds a row (before, after) to the table of parts. CPU time is the user and system time of
every process the command started and waited for (pytest, ranks, kernels, subprocesses): on
a machine other jobs share, wall time grows with their load and CPU time much less, so both
are reported, with the load average before and after each run.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

OUT = Path("benchmarks/results/test_time.md")
README_TESTS = 'pip install -q -c requirements/constraints.txt -e ".[dev]" && python -m pytest'
DURATION = re.compile(r"^\s*(\d+\.\d+)s (call|setup|teardown)\s+(\S.*)$")
# A doctest's id names the module's file; the table names the function it documents.
DOCTEST = re.compile(r"^fsdp_guide/\S+\.py::(?:\S+\.)?(\w+)$")
SUMMARY = re.compile(r"\d+ (passed|failed|error)")
WHOLE, PARTS = "## The whole suite", "## Before and after, on parts of the suite"
PARTS_HEADER = [
    PARTS,
    "",
    "Each part run with `python benchmarks/test_time.py --before REV --part NAME -- ARGS`:",
    "`python -m pytest ARGS` in a checkout of `REV` (before), then in this one (after), one",
    "after the other on the same machine. CPU time counts every process the run waited for.",
    "",
    "| part | pytest arguments | before | wall before | CPU before | after | wall after "
    "| CPU after | CPU saved | load average (1 min) |",
    "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | --- |",
]


@dataclass
class Timed:
    wall: float
    cpu: float
    status: int
    log: str
    load: tuple[float, float]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(command: list[str], cwd: Path, env: dict[str, str]) -> Timed:
    """Wall and CPU seconds of ``command``, its exit status and output."""
    load = os.getloadavg()[0]
    cpu, start = children_cpu_s(), time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        done = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
        out.seek(0)
        log = out.read()
    wall, used = time.perf_counter() - start, children_cpu_s() - cpu
    return Timed(wall, used, done.returncode, log, (load, os.getloadavg()[0]))


def slowest(log: str) -> list[tuple[float, str, str]]:
    found = []
    for line in log.splitlines():
        if match := DURATION.match(line):
            seconds, when, test = float(match[1]), match[2], match[3].strip()
            if doctest := DOCTEST.match(test):
                test = f"doctest of {doctest[1]}"
            # A `|` in a test's id would cut the table's row.
            found.append((seconds, when, test.replace("|", "\u00a6")))
    return sorted(found, reverse=True)[:30]


def summary(log: str) -> str:
    finals = [ln.strip("= ") for ln in log.splitlines() if " in " in ln and SUMMARY.search(ln)]
    return finals[-1] if finals else "no pytest summary line"


def sections() -> dict[str, str]:
    """The result file's parts, by heading (``""`` for what comes before the first)."""
    text = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
    found: dict[str, str] = {}
    for chunk in re.split(r"\n(?=## )", text):
        heading = chunk.splitlines()[0] if chunk.startswith("## ") else ""
        found[heading] = chunk.strip("\n")
    return found


def write(parts: dict[str, str]) -> None:
    ordered = [WHOLE, PARTS]
    body = [parts[h] for h in ordered if parts.get(h)]
    body += [t for h, t in parts.items() if h not in (*ordered, "") and t]
    OUT.write_text("\n\n".join(["# Test suite time", *body]) + "\n", encoding="utf-8")


def whole_suite(ci: bool) -> int:
    command = "bash .ci/run" if ci else README_TESTS
    env = {**os.environ, "PYTEST_ADDOPTS": "--durations=30 -q"}
    timed = run(["bash", "-c", command], Path.cwd(), env)
    what = "CI (`bash .ci/run`)" if ci else "the README's test command"
    cores = os.cpu_count()
    text = [
        WHOLE,
        "",
        f"One run of {what} on {platform.machine()}, {cores} cores, Python "
        f"{platform.python_version()}; load average {timed.load[0]:.1f} before, "
        f"{timed.load[1]:.1f} after (on a machine to itself it stays under {cores}).",
        "",
        "| command | exit status | wall time | CPU time (user + system) | CPU / wall |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| `{command}` | {timed.status} | {timed.wall / 60:.1f} min ({timed.wall:.0f} s) | "
        f"{timed.cpu / 60:.1f} min ({timed.cpu:.0f} s) | {timed.cpu / timed.wall:.2f} |",
        "",
        f"pytest: {summary(timed.log)}.",
        "",
        "The 30 slowest test phases:",
        "",
        "| seconds | phase | test |",
        "| ---: | --- | --- |",
        *(f"| {s:.2f} | {when} | `{test}` |" for s, when, test in slowest(timed.log)),
    ]
    parts = sections()
    parts[WHOLE] = "\n".join(text)
    write(parts)
    print(f"wrote {OUT}: wall {timed.wall:.0f} s, CPU {timed.cpu:.0f} s, exit {timed.status}")
    return timed.status


def before_and_after(rev: str, part: str, args: list[str], logs: Path | None) -> int:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args]

    def env(tree: Path) -> dict[str, str]:
        # The tree's package in pytest, in the lessons' kernels (whose cwd is notebooks/) and
        # in the ranks: an editable install would name this checkout's.
        return {**os.environ, "PYTHONPATH": str(tree.resolve())}

    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
        try:
            before = run(command, tree, env(tree))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], check=True)
    after = run(command, Path.cwd(), env(Path.cwd()))
    short = subprocess.run(
        ["git", "rev-parse", "--short", rev], capture_output=True, text=True, check=True
    ).stdout.strip()
    row = (
        f"| {part} | `{shlex.join(args)}` | {short}: {summary(before.log)} | {before.wall:.0f} s "
        f"| {before.cpu:.0f} s | {summary(after.log)} | {after.wall:.0f} s | {after.cpu:.0f} s "
        f"| {1 - after.cpu / before.cpu:.0%} | {before.load[0]:.1f}-{before.load[1]:.1f}, "
        f"{after.load[0]:.1f}-{after.load[1]:.1f} |"
    )
    if logs is not None:  # the whole output of both runs, durations included
        logs.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"\W+", "_", part).strip("_")
        (logs / f"{name}.before.log").write_text(before.log, encoding="utf-8")
        (logs / f"{name}.after.log").write_text(after.log, encoding="utf-8")
    parts = sections()
    kept = [
        line
        for line in parts.get(PARTS, "").splitlines()
        if line.startswith("| ") and not line.startswith(("| part ", "| --- ", f"| {part} |"))
    ]
    parts[PARTS] = "\n".join([*PARTS_HEADER, *kept, row])
    write(parts)
    print(row)
    return max(before.status, after.status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ci", action="store_true", help="time `bash .ci/run` instead")
    parser.add_argument("--before", metavar="REV", help="compare with this revision")
    parser.add_argument("--part", default="", help="the row's name (with --before)")
    parser.add_argument("--logs", type=Path, help="keep both runs' output here (with --before)")
    parser.add_argument("pytest_args", nargs="*", help="what pytest runs (with --before)")
    args = parser.parse_args()
    if args.before:
        if not args.pytest_args:
            parser.error("--before needs the pytest arguments of the part, after --")
        sys.exit(before_and_after(args.before, args.part or " ".join(args.pytest_args),
                                  args.pytest_args, args.logs))  # fmt: skip
    sys.exit(whole_suite(args.ci))


if __name__ == "__main__":
    main()
