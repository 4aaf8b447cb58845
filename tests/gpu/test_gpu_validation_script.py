"""The CPU-testable parts of the GPU validation of issue 17 (benchmarks/gpu_validation.py).

The script and its package, ``benchmarks/gpu/``, are loaded from their files. The steps
need a GPU; what is tested here is what they rely on and what runs anywhere: reading
pytest's summary line, the report, the merge of several calls, the plan and
``--dry-run``, running a step with its time limit, and the notebook helpers (stripping
``skip-execution``, copying the CUDA cells' outputs back).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import tarfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str, path: Path, package: bool = False) -> ModuleType:
    """Import ``path`` as ``name``, as running the script by path would find it.

    The script imports its package as ``gpu`` from its own directory, which Python puts on
    ``sys.path`` only when it runs the script: here the package is registered by name.
    """
    location = [str(path.parent)] if package else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=location)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_pkg = _load("gpu", BENCHMARKS / "gpu" / "__init__.py", package=True)
gv = _load("gpu_validation", BENCHMARKS / "gpu_validation.py")
output_ = importlib.import_module("gpu._output")
report_ = importlib.import_module("gpu._report")
steps_ = importlib.import_module("gpu._steps")
runner_ = importlib.import_module("gpu._runner")
machine_ = importlib.import_module("gpu._machine")
checks_ = importlib.import_module("gpu._checks")
notebooks_ = importlib.import_module("gpu._notebooks")


# -- pytest's summary line --------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("..s.\n===== 3 passed, 1 skipped in 2.50s =====\n", {"passed": 3, "skipped": 1}),
        (
            "28 passed, 1475 deselected, 3 warnings in 95.31s (0:01:35)",
            {"passed": 28, "deselected": 1475, "warnings": 3},
        ),
        ("1 failed, 27 passed, 1 warning in 80.00s", {"failed": 1, "passed": 27, "warnings": 1}),
        (
            "!!!! Interrupted: 1 error during collection !!!!\n==== 1 error in 3.10s ====",
            {"errors": 1},
        ),
        ("2 errors, 1 passed in 1.0s", {"errors": 2, "passed": 1}),
        ("2 xfailed, 1 xpassed in 1.0s", {"xfailed": 2, "xpassed": 1}),
        ("no tests ran in 0.01s", {}),
        ("\x1b[32m\x1b[1m3 passed\x1b[0m\x1b[32m in 0.12s\x1b[0m", {"passed": 3}),
        # The last summary line counts, not an earlier one.
        ("1 passed in 1.00s\nmore output\n2 failed in 3.00s", {"failed": 2}),
        # Our own steps print the same line.
        ("CHECK PASS x/y: ok\n7 failed, 1 passed in 0.20s", {"failed": 7, "passed": 1}),
    ],
)
def test_summary_line_is_read(output: str, expected: dict[str, int]) -> None:
    counts = output_.parse_summary(output)
    assert counts is not None
    got = {k: v for k, v in vars(counts).items() if k != "seconds" and v}
    assert got == expected
    assert counts.seconds is not None and counts.seconds > 0


@pytest.mark.parametrize(
    "output",
    ["", "no summary here", "Saved in 3.2s", "loss went 5 in 3s", "3 apples in 2.0s", "3 passed"],
)
def test_no_summary_line_gives_none(output: str) -> None:
    assert output_.parse_summary(output) is None


@pytest.mark.parametrize(
    ("passed", "failed", "skipped"), [(0, 0, 0), (3, 0, 0), (2, 1, 0), (0, 2, 1), (4, 0, 2)]
)
def test_summary_line_round_trips(passed: int, failed: int, skipped: int) -> None:
    counts = output_.parse_summary(output_.summary_line(passed, failed, skipped, 1.25))
    assert counts is not None
    assert (counts.passed, counts.failed, counts.skipped, counts.seconds) == (
        passed,
        failed,
        skipped,
        1.25,
    )


@pytest.mark.parametrize(
    ("returncode", "timed_out", "counts", "status"),
    [
        (0, False, None, "passed"),
        (0, False, {"passed": 3}, "passed"),
        (0, False, {"passed": 3, "failed": 1}, "failed"),
        (0, False, {"errors": 1}, "failed"),
        (1, False, {"passed": 3}, "failed"),
        (5, False, {}, "failed"),  # pytest: no test collected
        (None, True, None, "timed out"),
    ],
)
def test_step_status(
    returncode: int | None, timed_out: bool, counts: dict[str, int] | None, status: str
) -> None:
    parsed = output_.Counts(**counts) if counts is not None else None
    assert output_.step_status(returncode, timed_out, parsed) == status


# -- environment and report -------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (
            "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB\n",
            {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "gpu_memory": "81559 MiB"},
        ),
        (
            "NVIDIA H200, 580.159.03, 143771 MiB\nNVIDIA H200, 580.159.03, 143771 MiB\n",
            {"gpu": "NVIDIA H200", "driver": "580.159.03", "gpu_memory": "143771 MiB"},
        ),
        ("NVIDIA-SMI has failed because it couldn't communicate with the driver", {}),
        ("", {}),
    ],
)
def test_nvidia_smi_is_read(output: str, expected: dict[str, str]) -> None:
    assert machine_.parse_nvidia_smi(output) == expected


def test_output_tail_is_safe_for_the_docs() -> None:
    text = "\n".join(f"line {i}" for i in range(100)) + "\n\x1b[31m  | Name | Type\x1b[0m\n"
    tail = output_.output_tail(text, lines=5)
    assert tail.splitlines() == ["line 96", "line 97", "line 98", "line 99", "  ¦ Name | Type"]
    assert not any(line.lstrip().startswith("|") for line in tail.splitlines())
    assert len(output_.output_tail("x" * 10_000, chars=100)) == 100


@pytest.mark.parametrize(("text", "fence"), [("plain", "```"), ("a ``` b", "````"), ("`x`", "```")])
def test_fenced_block_outlasts_the_backticks_inside(text: str, fence: str) -> None:
    block = report_.fenced(text)
    assert block.startswith(fence + "text\n") and block.endswith("\n" + fence)
    assert not block.startswith(fence + "`")


def test_markdown_table_keeps_one_cell_per_column() -> None:
    rows = [{"a": "x|y", "b": 1234567, "c": 0.000123456}, {"a": "multi\nline", "b": 2.0}]
    lines = report_.markdown_table(rows).splitlines()
    assert lines[0] == "| a | b | c |"
    assert all(line.count("|") == 4 for line in lines)
    assert lines[2] == "| x/y | 1,234,567 | 0.0001235 |"
    assert lines[3] == "| multi line | 2 |  |"
    assert report_.markdown_table([]) == ""


def _result(name: str, status: str, **kwargs: Any) -> Any:
    return report_.StepResult(
        name=name, command=f"python run {name}", limit=60.0, status=status, **kwargs
    )


ENV = {
    "gpu": "NVIDIA H100 80GB HBM3",
    "driver": "580.159.04",
    "gpu_memory": "81559 MiB",
    "torch": "2.11.0+cu130",
    "cuda": "13.0",
    "python": "3.12.3",
    "packages": {"torch": "2.11.0", "fairscale": "0.4.13", "deepspeed": None},
    "started": "2026-12-01 10:00 UTC",
}


def test_report_lists_every_step_and_shows_failures_only() -> None:
    results = [
        _result("pytest", "passed", counts=output_.Counts(passed=28), seconds=95.3, call="1"),
        _result(
            "memory",
            "failed",
            counts=output_.Counts(passed=3, failed=1),
            tail="Traceback\n  | weird line",
            data={"Peak (GB)": [{"variant": "plain", "peak": 11.3}]},
            call="1",
        ),
        _result("notebook 07_lightning_strategies", "timed out", tail="killed", call="2"),
        _result("fairscale", "not run", call="2"),
    ]
    report = report_.render_report(ENV, results, notes="Fixed lesson 04's targets.")
    assert report.startswith("# GPU validation (issue 17)\n")
    assert "NVIDIA H100 80GB HBM3 (81559 MiB), driver 580.159.04" in report
    assert "torch 2.11.0+cu130, CUDA 13.0" in report and "fairscale 0.4.13" in report
    assert "deepspeed" not in report  # not installed there: not listed
    assert "in calls 1, 2." in report
    table = [line for line in report.splitlines() if line.startswith("| ")]
    header = table[0]
    assert header.startswith("| step | command | result | passed | failed | skipped |")
    assert all(line.count("|") == header.count("|") for line in table[:6])
    assert "| pytest | `python run pytest` | passed | 28 | 0 | 0 | 95.3 | 60 |" in report
    assert "### Peak (GB)" in report and "| plain | 11.3 |" in report
    failures = report.split("## Failures", 1)[1]
    assert "### memory: failed" in failures and "  ¦ weird line" in failures
    assert "### notebook 07_lightning_strategies: timed out" in failures
    assert "pytest:" not in failures and "fairscale:" not in failures
    assert "Not run (out of time in that call): fairscale." in report
    assert report.rstrip().endswith("Fixed lesson 04's targets.")


def test_report_of_a_clean_run_has_no_failure_section() -> None:
    report = report_.render_report(
        ENV, [_result("pytest", "passed", counts=output_.Counts(passed=1))]
    )
    assert "## Failures" not in report and "## Notes" not in report


def test_results_survive_json_and_calls_merge() -> None:
    first = {
        "environment": {**ENV, "torch": "old"},
        "steps": [
            _result("pytest", "failed", counts=output_.Counts(failed=1)).as_json(),
            _result("fairscale", "passed").as_json(),
        ],
    }
    second = {
        "environment": {"torch": "2.11.0+cu130", "started": "later"},
        "steps": [_result("pytest", "passed", counts=output_.Counts(passed=28)).as_json()],
    }
    env, steps = report_.merge_reports([json.loads(json.dumps(r)) for r in (first, second)])
    assert env["torch"] == "2.11.0+cu130" and env["started"] == ENV["started"]
    assert [(s.name, s.status) for s in steps] == [("pytest", "passed"), ("fairscale", "passed")]
    assert steps[0].counts == output_.Counts(passed=28)


def test_step_data_lines_are_collected_by_title() -> None:
    checks = checks_.Checks("demo")
    output = "\n".join(
        [
            output_.DATA_PREFIX + json.dumps({"t": [{"a": 1}]}),
            "noise",
            output_.DATA_PREFIX + "{not json",
            output_.DATA_PREFIX + json.dumps({"t": [{"a": 2}], "u": [{"b": 3}]}),
        ]
    )
    assert output_.parse_data(output) == {"t": [{"a": 1}, {"a": 2}], "u": [{"b": 3}]}
    assert checks.finish() == 0


def test_checks_print_what_the_runner_reads(capsys: pytest.CaptureFixture[str]) -> None:
    checks = checks_.Checks("demo")
    checks.record("ok", True, "fine")
    checks.record("bad", False, "broken")
    checks.skip("later", "no GPU")
    checks.guard("raises", lambda: print(1 / 0))
    checks.table("Demo table", {"x": 1})
    assert checks.finish() == 1
    out = capsys.readouterr().out
    assert "CHECK FAIL demo/raises: raised ZeroDivisionError" in out
    assert output_.parse_summary(out) == output_.Counts(
        passed=1, failed=2, skipped=1, seconds=output_.parse_summary(out).seconds
    )
    assert output_.parse_data(out) == {"Demo table": [{"x": 1}]}


@pytest.mark.parametrize(
    ("limit", "remaining", "expected"), [(300, 1000, 300), (300, 100, 95.0), (300, 24, None)]
)
def test_a_step_gets_what_is_left_of_the_budget(
    limit: float, remaining: float, expected: float | None
) -> None:
    assert runner_.effective_limit(limit, remaining) == expected


# -- running steps ----------------------------------------------------------------------


def _step(name: str, code: str, limit: float = 20.0) -> Any:
    return steps_.Step(name, (sys.executable, "-c", code), limit)


@pytest.mark.parametrize(
    ("code", "status", "returncode"),
    [
        ("print('2 passed, 1 skipped in 0.01s')", "passed", 0),
        ("print('1 failed, 1 passed in 0.01s'); raise SystemExit(1)", "failed", 1),
        ("import sys; print('boom', file=sys.stderr); sys.exit(3)", "failed", 3),
    ],
)
def test_run_step_records_exit_counts_and_output(
    tmp_path: Path, code: str, status: str, returncode: int
) -> None:
    result = runner_.run_step(_step("demo step", code), 20.0, tmp_path / "logs", call="1")
    assert (result.status, result.returncode) == (status, returncode)
    assert (tmp_path / "logs" / "demo_step.log").exists()
    assert result.seconds < 20
    if status == "failed":
        assert result.tail  # kept for the report
    else:
        assert result.counts == output_.Counts(passed=2, skipped=1, seconds=0.01)


def test_run_step_kills_a_step_at_its_limit(tmp_path: Path) -> None:
    code = "import time; print('started', flush=True); time.sleep(60)"
    result = runner_.run_step(_step("slow", code), 0.5, tmp_path, call="1")
    assert result.status == "timed out" and result.returncode is None
    assert result.seconds < 10 and "started" in result.tail


def test_runner_writes_json_and_report_and_respects_the_budget(tmp_path: Path) -> None:
    args = gv.parse_args(
        [
            "--work-dir",
            str(tmp_path / "work"),
            "--results",
            str(tmp_path / "report.md"),
            "--budget",
            "60",
            "--jobs",
            "2",
        ]
    )
    # The budget counts from the script's start otherwise.
    runner = gv.make_runner(args, dict(ENV), start=time.monotonic())
    fast = _step("fast", "print('1 passed in 0.01s')")
    plan = [
        fast,
        steps_.Step("p1", fast.argv, 20.0, parallel=True),
        steps_.Step("p2", fast.argv, 20.0, True),
    ]
    runner.run(plan)
    assert [(r.name, r.status) for r in runner.results] == [
        ("fast", "passed"),
        ("p1", "passed"),
        ("p2", "passed"),
    ]
    saved = json.loads((tmp_path / "work" / "gpu_validation.json").read_text())
    assert {s["name"] for s in saved["steps"]} == {"fast", "p1", "p2"}
    assert "| fast |" in (tmp_path / "report.md").read_text()
    runner.start -= 50  # 10 s of the budget left: too little to start a step
    assert runner.run_one(fast).status == "not run"
    archive = tmp_path / "artifacts.tar.gz"
    runner_.pack(tmp_path / "work", archive)
    with tarfile.open(archive) as tar:
        assert "logs/fast.log" in tar.getnames()


# -- the plan and the command line ------------------------------------------------------


def test_plan_keeps_the_step_order_and_runs_notebooks_in_parallel(tmp_path: Path) -> None:
    notebooks = [Path("/x/notebooks/01_a.ipynb"), Path("/x/notebooks/02_b.ipynb")]
    plan = steps_.build_plan(["notebooks", "memory", "pytest"], tmp_path, notebooks, 200.0)
    assert [s.name for s in plan] == ["pytest", "memory", "notebook 01_a", "notebook 02_b"]
    assert [s.parallel for s in plan] == [False, False, True, True]
    assert (
        plan[0].command == "python -m pytest -m gpu -q -rfEs --continue-on-collection-errors tests"
    )
    assert plan[2].limit == 200.0 and plan[2].argv[-2:] == ("--deadline", "175")


def test_notebook_selection_by_prefix() -> None:
    assert [p.name[:2] for p in notebooks_.notebook_paths(["07", "04"])] == ["07", "04"]
    assert len(notebooks_.notebook_paths()) >= 9
    with pytest.raises(ValueError, match="starts with 'nope'"):
        notebooks_.notebook_paths(["nope"])


def test_dry_run_prints_the_plan_without_running_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        gv.main(["--dry-run", "--step", "pytest", "--step", "notebooks", "--notebook", "07"]) == 0
    )
    out = capsys.readouterr().out
    pytest_line = "- pytest [serial, limit 330 s]: python -m pytest -m gpu -q -rfEs"
    assert pytest_line + " --continue-on-collection-errors tests" in out
    assert "notebook 07_" in out and "notebook 04_" not in out and "- fairscale" not in out
    assert gv.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in steps_.STEP_NAMES[:-1]:
        assert f"- {name} [serial" in out
    assert gv.main(["--dry-run", "--step", "notebooks", "--notebook", "nope"]) == 2


def test_merge_writes_the_report(tmp_path: Path) -> None:
    calls = []
    for i, result in enumerate([_result("pytest", "passed"), _result("notebook 01", "passed")]):
        path = tmp_path / f"call{i}.json"
        path.write_text(json.dumps({"environment": ENV, "steps": [result.as_json()]}))
        calls.append(str(path))
    target = tmp_path / "results" / "gpu_validation.md"
    assert gv.main(["--merge", *calls, "--results", str(target)]) == 0
    text = target.read_text()
    assert "| pytest |" in text and "| notebook 01 |" in text


# -- notebooks --------------------------------------------------------------------------


def _cell(cell_id: str, source: str, tags: list[str] | None = None, outputs: Any = ()) -> Any:
    metadata: dict[str, Any] = {"tags": tags} if tags else {}
    return {
        "cell_type": "code",
        "id": cell_id,
        "metadata": metadata,
        "source": source.splitlines(keepends=True),
        "outputs": list(outputs),
        "execution_count": None,
    }


def test_skip_execution_is_stripped_in_a_copy_and_restored() -> None:
    notebook = {
        "cells": [
            _cell("a", "x = 1", ["skip-execution", "nbval-skip"]),
            _cell("b", "y = 2", ["nbval-check-output"]),
            _cell("c", "z = 3"),
        ]
    }
    copy_, ids = notebooks_.strip_tag(notebook)
    assert ids == ["a"]
    assert copy_["cells"][0]["metadata"]["tags"] == ["nbval-skip"]
    assert notebook["cells"][0]["metadata"]["tags"] == ["skip-execution", "nbval-skip"]
    notebooks_.restore_tag(copy_, ids)
    assert copy_["cells"][0]["metadata"]["tags"] == ["skip-execution", "nbval-skip"]
    assert copy_["cells"][1:] == notebook["cells"][1:]


@pytest.mark.parametrize(
    ("source", "tags", "expected"),
    [
        ("if torch.cuda.is_available():\n    pass", None, True),
        ("model = model.cuda()", None, True),
        ('launch(f, 2, backend="nccl")', None, True),
        ('if PLAN.backend == "nccl":\n    pass', None, True),
        ('pl.Trainer(accelerator="gpu")', None, True),
        ("print('plain')", ["skip-execution"], True),
        ("print('plain')", ["nbval-check-output"], False),
        ("print('cpu only')", None, False),
    ],
)
def test_cuda_cells_are_recognised(source: str, tags: list[str] | None, expected: bool) -> None:
    assert notebooks_.is_cuda_cell(_cell("x", source, tags)) is expected
    assert notebooks_.is_cuda_cell({"cell_type": "markdown", "source": source}) is False


def test_cuda_outputs_are_copied_back_only_where_safe() -> None:
    gpu_output = [{"output_type": "stream", "name": "stdout", "text": ["on the GPU\n"]}]
    original = {
        "cells": [
            _cell("gpu", "if torch.cuda.is_available():\n    run()", outputs=[{"old": 1}]),
            _cell("edited", "if torch.cuda.is_available():\n    new()"),
            _cell("checked", "print(torch.cuda.is_available())", ["nbval-check-output"]),
            _cell("cpu", "print('cpu')", outputs=[{"cpu": 1}]),
            _cell("missing", "x.cuda()"),
        ]
    }
    executed = {
        "cells": [
            _cell("gpu", "if torch.cuda.is_available():\n    run()", outputs=gpu_output),
            _cell("edited", "if torch.cuda.is_available():\n    old()", outputs=gpu_output),
            _cell("checked", "print(torch.cuda.is_available())", outputs=gpu_output),
            _cell("cpu", "print('cpu')", outputs=[{"gpu": 1}]),
        ]
    }
    executed["cells"][0]["execution_count"] = 7
    note = report_.gpu_note(
        {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "cuda": "13.0"}
    )
    copied, messages = notebooks_.copy_cuda_outputs(original, executed, note)
    assert copied == 1
    gpu, edited, checked, cpu, _ = original["cells"]
    assert gpu["outputs"] == gpu_output and gpu["execution_count"] == 7
    assert gpu["metadata"]["fsdp_guide"]["outputs_from"] == (
        "one NVIDIA H100 80GB HBM3, torch 2.11.0+cu130 (CUDA 13.0)"
    )
    assert edited["outputs"] == [] and checked["outputs"] == [] and cpu["outputs"] == [{"cpu": 1}]
    assert [m.split(":")[0] for m in messages] == ["cell edited", "cell checked", "cell missing"]


def test_copy_back_writes_the_notebook_as_jupyter_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    notebooks, executed_dir = tmp_path / "notebooks", tmp_path / "executed"
    notebooks.mkdir()
    executed_dir.mkdir()
    source = "if torch.cuda.is_available():\n    print('gpu')"
    original = {"cells": [_cell("a", source)], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    executed = json.loads(json.dumps(original))
    executed["cells"][0]["outputs"] = [
        {"output_type": "stream", "name": "stdout", "text": ["gpu\n"]}
    ]
    (notebooks / "01_x.ipynb").write_text(json.dumps(original, indent=1) + "\n")
    (executed_dir / "01_x.ipynb").write_text(json.dumps(executed, indent=1) + "\n")
    (executed_dir / "99_gone.ipynb").write_text(json.dumps(executed))
    run_json = tmp_path / "call.json"
    run_json.write_text(json.dumps({"environment": ENV, "steps": []}))
    monkeypatch.setattr(notebooks_, "NOTEBOOKS", notebooks)
    assert gv.main(["--copy-cuda-outputs", str(executed_dir), "--from-json", str(run_json)]) == 0
    text = (notebooks / "01_x.ipynb").read_text()
    written = json.loads(text)
    assert written["cells"][0]["outputs"] == executed["cells"][0]["outputs"]
    assert text == json.dumps(written, indent=1, ensure_ascii=False) + "\n"
    out = capsys.readouterr().out
    assert "01_x.ipynb: outputs of 1 CUDA cell(s) copied" in out
    assert "99_gone.ipynb: no such notebook" in out
    assert "one NVIDIA H100 80GB HBM3, torch 2.11.0+cu130 (CUDA 13.0)" in out


def test_the_packages_docstring_examples_hold() -> None:
    import doctest
    import pkgutil

    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    failed = attempted = 0
    for info in pkgutil.iter_modules(gpu_pkg.__path__, "gpu."):
        result = doctest.testmod(importlib.import_module(info.name), optionflags=flags)
        failed, attempted = failed + result.failed, attempted + result.attempted
    assert failed == 0 and attempted >= 32
