"""The GPU run: every ``gpu``-marked test, then every lesson with its CUDA cells, one report.

Two parts, each a standard tool:

1. ``python -m pytest -m gpu -q -rfEs tests``: the CUDA tests (FairScale FSDP, Lightning's
   ``DDPFullyShardedStrategy``, CUDA peak memory against the planner, FairScale checkpoints).
   Without a GPU, ``tests/conftest.py`` skips every one of them.
2. Each lesson executed top to bottom with nbclient, in its own kernel. With a GPU visible the
   cells tagged ``skip-execution`` (CUDA only, skipped by CPU CI) run too; without one they are
   skipped as on CI. Executed copies go to ``OUT/executed/`` for review.

It writes ``OUT/gpu_validation.md`` (device, each command, its result and wall time, the tail
of what failed) and exits 1 when anything failed. Nothing is started once ``--budget`` seconds
have passed: what was not run is reported "not run", to run in another call (``--notebook``).

Usage, from the repository root (``benchmarks/gpu_run.md`` for the GPU machine)::

    python benchmarks/gpu_validation.py --out benchmarks/out/gpu_run
    python benchmarks/gpu_validation.py --no-tests --notebook 04 --notebook 07
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CUDA_TAG = "skip-execution"  # the lessons' CUDA-only cells (and nbval-skip)
NEVER = "fsdp-guide-no-cell-has-this-tag"  # what nbclient skips when a GPU runs every cell


@dataclass(frozen=True)
class Result:
    """One command of the run: what it was, how it ended, and the end of its output."""

    name: str
    command: str
    status: str  # "passed", "failed", "not run"
    seconds: float
    summary: str
    tail: str = ""


def device() -> tuple[bool, str]:
    """Whether CUDA is usable here, and the machine in words (GPU, torch, CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return False, f"no CUDA device visible; torch {torch.__version__}"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return True, f"{', '.join(names)}; torch {torch.__version__} (CUDA {torch.version.cuda})"


def _timed_out(stopped: subprocess.TimeoutExpired, seconds: float) -> str:
    """What a stopped command printed (it may come back as bytes), and that it was stopped."""
    partial = stopped.stdout or b""
    text = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
    return f"{text}\ntimed out after {seconds:.0f} s"


def _result(
    name: str, command: str, output: str, ok: bool, start: float, log: Path | None
) -> Result:
    """A finished command's row: its last line as the summary, the tail when it failed; its
    whole output goes to ``log`` when given."""
    if log is not None:
        log.write_text(output)
    lines = [line for line in output.splitlines() if line.strip()]
    return Result(
        name=name,
        command=command,
        status="passed" if ok else "failed",
        seconds=time.monotonic() - start,
        summary=lines[-1][:200] if lines else "",
        tail="\n".join(lines[-40:]) if not ok else "",
    )


def run_tests(paths: list[str], seconds: float, log: Path | None = None) -> Result:
    """``pytest -m gpu`` over ``paths`` in a subprocess, stopped after ``seconds``; its whole
    output goes to ``log`` when given."""
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", *paths]
    if seconds <= 0:
        return Result("pytest -m gpu", " ".join(command[1:]), "not run", 0.0, "no time left")
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=max(seconds, 1)
        )
        output, ok = done.stdout + done.stderr, done.returncode in (0, 5)  # 5: none collected
    except subprocess.TimeoutExpired as stopped:
        output, ok = _timed_out(stopped, seconds), False
    return _result("pytest -m gpu", " ".join(command[1:]), output, ok, start, log)


def run_command(name: str, command: str, seconds: float, log: Path) -> Result:
    """A further shell command of the run (a benchmark, a lesson set with other settings),
    stopped after ``seconds``; its whole output goes to ``log``."""
    if seconds <= 0:
        return Result(name, command, "not run", 0.0, "no time left")
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=seconds
        )
        output, ok = done.stdout + done.stderr, done.returncode == 0
        if not ok:
            output += f"\nexit code {done.returncode}"
    except subprocess.TimeoutExpired as stopped:
        output, ok = _timed_out(stopped, seconds), False
    return _result(name, command, output, ok, start, log)


def run_notebook(path: str, out: str, cuda: bool, cell_timeout: float, deadline: float) -> Result:
    """Execute one notebook with nbclient (in a pool's process); write its executed copy."""
    import nbformat
    from nbclient import NotebookClient

    name, command = Path(path).name, f"nbclient {Path(path).name}"
    if time.time() >= deadline:
        return Result(name, command, "not run", 0.0, "the budget was spent")
    notebook = nbformat.read(path, as_version=4)  # type: ignore[no-untyped-call]
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        record_timing=False,
        skip_cells_with_tag=NEVER if cuda else CUDA_TAG,
        timeout_func=lambda cell: max(1, int(min(cell_timeout, deadline - time.time()))),
        resources={"metadata": {"path": str(Path(path).parent)}},
    )
    start, error = time.monotonic(), ""
    try:
        client.execute()
    except Exception as exc:  # a cell's error, a timeout or a dead kernel: all reported
        error = f"{type(exc).__name__}: {exc}"
    executed = Path(out) / "executed" / name
    executed.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, str(executed))  # type: ignore[no-untyped-call]
    cells = sum(cell.cell_type == "code" for cell in notebook.cells)
    tagged = sum(CUDA_TAG in cell.metadata.get("tags", []) for cell in notebook.cells)
    ran = "run" if cuda else "skipped"
    return Result(
        name=name,
        command=command,
        status="failed" if error else "passed",
        seconds=time.monotonic() - start,
        summary=f"{cells} code cells, {tagged} tagged {CUDA_TAG} ({ran})",
        tail=error[-3000:],
    )


def notebook_paths(selection: list[str]) -> list[Path]:
    """Every lesson, or those whose file name starts with a selection (or a path given)."""
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if not selection:
        return paths
    chosen: list[Path] = []
    for wanted in selection:
        matches = [Path(wanted)] if wanted.endswith(".ipynb") else []
        matches = matches or [p for p in paths if p.name.startswith(wanted)]
        if not matches or not matches[0].is_file():
            sys.exit(f"--notebook {wanted}: no such notebook (names start 01, 02, ...)")
        chosen += [p for p in matches if p not in chosen]
    return chosen


def report(where: str, results: list[Result]) -> str:
    """The markdown report: the device, one row per command, then what failed."""
    rows = [
        f"| {r.name} | `{r.command}` | {r.status} | {r.seconds:.0f} | {r.summary} |"
        for r in results
    ]
    lines = [
        "# GPU run",
        "",
        f"Device: {where}.",
        "",
        "| part | command | result | seconds | summary |",
        "| --- | --- | --- | ---: | --- |",
        *rows,
    ]
    for r in results:
        if r.tail:
            lines += ["", f"## {r.name}: {r.status}", "", "```text", r.tail, "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the tests, then the notebooks; write the report; 1 when anything failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "gpu_run")
    parser.add_argument("--tests", nargs="*", default=["tests"], help="paths for pytest")
    parser.add_argument("--no-tests", action="store_true", help="skip part 1")
    parser.add_argument("--notebook", action="append", default=[], help="name prefix or path")
    parser.add_argument("--no-notebooks", action="store_true", help="skip part 2")
    parser.add_argument("--jobs", type=int, default=3, help="notebooks at a time")
    parser.add_argument("--cell-timeout", type=float, default=300.0)
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for everything")
    parser.add_argument(
        "--command",
        action="append",
        default=[],
        metavar="NAME=SHELL",
        help="a further command, run beside the tests and the lessons (one GPU, many cores)",
    )
    parser.add_argument(
        "--concurrent", action="store_true", help="run the tests beside the lessons, not first"
    )
    args = parser.parse_args(argv)
    for spec in args.command:
        if "=" not in spec:
            parser.error(f"--command {spec!r}: write it NAME=SHELL")
    deadline = time.time() + args.budget
    cuda, where = device()
    print(f"Device: {where}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    side = ThreadPoolExecutor(max(1, len(args.command) + 1))
    beside = [
        side.submit(run_command, n, c, deadline - time.time(), args.out / f"{n}.log")
        for n, c in (spec.split("=", 1) for spec in args.command)
    ]
    if not args.no_tests:
        if args.concurrent:
            tests = side.submit(
                run_tests, args.tests, deadline - time.time(), args.out / "pytest.log"
            )
            beside.insert(0, tests)
        else:
            results.append(run_tests(args.tests, deadline - time.time(), args.out / "pytest.log"))
            print(f"pytest -m gpu: {results[-1].status}, {results[-1].summary}", flush=True)
    if not args.no_notebooks:
        paths = [str(p) for p in notebook_paths(args.notebook)]
        context = get_context("spawn")  # a kernel per notebook; nothing CUDA is inherited
        with ProcessPoolExecutor(max(1, args.jobs), mp_context=context) as pool:
            runs = [
                pool.submit(run_notebook, p, str(args.out), cuda, args.cell_timeout, deadline)
                for p in paths
            ]
            for run in runs:
                results.append(run.result())
                print(f"{results[-1].name}: {results[-1].status}", flush=True)
    for future in beside:
        results.append(future.result())
        print(f"{results[-1].name}: {results[-1].status}, {results[-1].summary}", flush=True)
    side.shutdown()
    (args.out / "gpu_validation.md").write_text(report(where, results))
    (args.out / "gpu_validation.json").write_text(
        json.dumps({"device": where, "results": [vars(r) for r in results]}, indent=1)
    )
    print(f"wrote {args.out / 'gpu_validation.md'}", flush=True)
    return 1 if any(r.status != "passed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
