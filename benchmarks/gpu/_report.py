"""Steps' results, their JSON, the merge of several calls, and the markdown report."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._output import Counts, Tables, output_tail


@dataclass
class StepResult:
    """What one step did.

    Attributes:
        name: Step name (``pytest``, ``fairscale``, ``notebook 04_...``).
        command: The command, as shown in the report.
        limit: Seconds it was allowed.
        status: ``passed``, ``failed``, ``timed out`` or ``not run``.
        returncode: Its exit status (``None`` when killed or not run).
        seconds: Wall time.
        counts: Its summary line's counts, when it printed one.
        tail: The end of its output (kept for failures).
        data: Tables the step printed on a ``GPU_VALIDATION_DATA`` line: title to rows.
        call: Which call of the script ran it (``--call-label``).
    """

    name: str
    command: str
    limit: float
    status: str
    returncode: int | None = None
    seconds: float = 0.0
    counts: Counts | None = None
    tail: str = ""
    data: Tables = field(default_factory=dict)
    call: str = ""

    def as_json(self) -> dict[str, Any]:
        """JSON-ready values."""
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> StepResult:
        """The result that :meth:`as_json` gave."""
        counts = value.get("counts")
        return cls(**{**value, "counts": Counts(**counts) if counts else None})


def fenced(text: str, info: str = "text") -> str:
    """``text`` in a fenced code block whose fence is longer than any backtick run in it.

    Examples:
        >>> print(fenced("x = 1"))
        ```text
        x = 1
        ```
        >>> fenced("a ```` b").splitlines()[0]
        '`````text'
    """
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text}\n{fence}"


def _cell(value: object) -> str:
    """A value as a markdown table cell (no ``|``, no line break)."""
    if isinstance(value, float):
        text = f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    elif isinstance(value, int) and not isinstance(value, bool):
        text = f"{value:,}"
    else:
        text = str(value)
    return " ".join(text.replace("|", "/").split())


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows of the same keys as a markdown table; the first row's keys are the columns.

    Examples:
        >>> print(markdown_table([{"mode": "a|b", "loss": 0.123456}, {"mode": "c", "loss": 2}]))
        | mode | loss |
        | --- | --- |
        | a/b | 0.1235 |
        | c | 2 |
    """
    if not rows:
        return ""
    columns = list(rows[0])
    lines = [
        "| " + " | ".join(_cell(c) for c in columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
    ]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def environment_line(env: dict[str, Any]) -> str:
    """One sentence naming the machine and the versions.

    Examples:
        >>> environment_line({"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159.04",
        ...                   "gpu_memory": "81559 MiB", "torch": "2.11.0+cu130", "cuda": "13.0"})
        'Device: NVIDIA H100 80GB HBM3 (81559 MiB), driver 580.159.04; torch 2.11.0+cu130, CUDA 13.0.'
    """  # noqa: E501
    gpu = env.get("gpu") or env.get("device") or "no GPU seen"
    memory = f" ({env['gpu_memory']})" if env.get("gpu_memory") else ""
    versions = f"torch {env.get('torch', 'unknown')}, CUDA {env.get('cuda', 'unknown')}"
    if env.get("cudnn"):
        versions += f", cuDNN {env['cudnn']}"
    if env.get("nccl"):
        versions += f", NCCL {env['nccl']}"
    return f"Device: {gpu}{memory}, driver {env.get('driver', 'unknown')}; {versions}."


def gpu_note(env: dict[str, Any]) -> str:
    """Where GPU outputs come from, in words.

    Examples:
        >>> gpu_note({"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "cuda": "13.0"})
        'one NVIDIA H100 80GB HBM3, torch 2.11.0+cu130 (CUDA 13.0)'
    """
    gpu = env.get("gpu") or env.get("device") or "GPU"
    return f"one {gpu}, torch {env.get('torch', '?')} (CUDA {env.get('cuda', '?')})"


def render_report(env: dict[str, Any], results: Sequence[StepResult], notes: str = "") -> str:
    """The markdown report: environment, a table of steps, measurements, failures.

    Args:
        env: What :func:`._machine.collect_environment` found (merged over calls).
        results: Every step's result, in the order run.
        notes: Markdown added under "Notes" (what failed and how it was fixed).

    Returns:
        The report, ending with a newline.
    """
    lines = ["# GPU validation (issue 17)", "", environment_line(env)]
    packages = env.get("packages") or {}
    if packages:
        listed = ", ".join(f"{k} {v}" for k, v in packages.items() if v and k != "torch")
        lines.append(f"Python {env.get('python', 'unknown')}; {listed}.")
    if env.get("started"):
        calls = sorted({r.call for r in results if r.call})
        lines.append(
            f"Run started {env['started']}" + (f", in calls {', '.join(calls)}." if calls else ".")
        )
    lines += ["", "Counts are pytest's for `pytest` and checks for the other steps.", ""]
    rows = []
    for r in results:
        c = r.counts
        rows.append(
            {
                "step": r.name,
                "command": f"`{r.command}`",
                "result": r.status,
                "passed": c.passed + c.xpassed if c else "",
                "failed": c.failed + c.errors if c else "",
                "skipped": c.skipped + c.xfailed if c else "",
                "time (s)": round(r.seconds, 1),
                "limit (s)": round(r.limit),
            }
        )
    lines.append(markdown_table(rows))
    tables: Tables = {}
    for r in results:
        for name, table_rows in r.data.items():
            tables.setdefault(name, []).extend(table_rows)
    if tables:
        lines += ["", "## Measurements"]
        for name, table_rows in tables.items():
            lines += ["", f"### {name}", "", markdown_table(table_rows)]
    failed = [r for r in results if r.status not in ("passed", "not run")]
    if failed:
        lines += ["", "## Failures"]
        for r in failed:
            lines += ["", f"### {r.name}: {r.status}", "", f"`{r.command}`", ""]
            lines.append(fenced(output_tail(r.tail) or "(no output)"))
    not_run = [r.name for r in results if r.status == "not run"]
    if not_run:
        lines += ["", "Not run (out of time in that call): " + ", ".join(not_run) + "."]
    if notes.strip():
        lines += ["", "## Notes", "", notes.strip()]
    return "\n".join(lines) + "\n"


def merge_reports(reports: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], list[StepResult]]:
    """One environment and one list of steps from the JSON files of several calls.

    A step run in several calls keeps its last result, at the place of its first.

    Examples:
        >>> a = {"environment": {"gpu": "X", "started": "t0"},
        ...      "steps": [{"name": "pytest", "command": "c", "limit": 1.0, "status": "failed"}]}
        >>> b = {"environment": {"torch": "2.11"},
        ...      "steps": [{"name": "pytest", "command": "c", "limit": 1.0, "status": "passed"}]}
        >>> env, steps = merge_reports([a, b])
        >>> env, [(s.name, s.status) for s in steps]
        ({'gpu': 'X', 'started': 't0', 'torch': '2.11'}, [('pytest', 'passed')])
    """
    env: dict[str, Any] = {}
    by_name: dict[str, StepResult] = {}
    for report in reports:
        for key, value in report.get("environment", {}).items():
            if key != "started" or "started" not in env:
                env[key] = value
        for step in report.get("steps", []):
            result = StepResult.from_json(step)
            by_name[result.name] = result
    return env, list(by_name.values())


def read_json(path: Path) -> dict[str, Any]:
    """The JSON file of a call (see :func:`write_json`)."""
    value: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return value


def write_json(path: Path, env: dict[str, Any], call: str, results: Sequence[StepResult]) -> None:
    """The JSON of one call: its environment and its steps' results, to merge later."""
    report = {"environment": env, "call": call, "steps": [r.as_json() for r in results]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


def write_markdown(
    path: Path, env: dict[str, Any], results: Sequence[StepResult], notes: Path | None
) -> None:
    """The report of :func:`render_report`, with the ``notes`` file's text when it exists."""
    text = notes.read_text(encoding="utf-8") if notes is not None and notes.exists() else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(env, results, text), encoding="utf-8")
