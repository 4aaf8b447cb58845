"""What a reader sees in a lesson names public APIs only and carries no note meant for us.

Markdown, code (comments included) and stored outputs of every notebook are searched for
private module paths (``fsdp_guide.memory._report``), notebook-checking machinery (cell tags,
nbval), figure-maintenance notes, repository paths of maintainer scripts, and words from the
project's planning.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LESSONS = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))

FORBIDDEN = {
    "a private module path": r"fsdp_guide(?:[./][A-Za-z]\w*)*[./]_[A-Za-z]\w*",
    "a planning name": r"\bseed\s*0\d\d\b|\bthe integrator\b|\bacceptance\b|\bissue\s*#?\d+",
    "notebook-checking machinery": r"\bnbval\b|skip-execution|raises-exception|\btagged\b",
    "a maintainer note": r"redraw it with|refreshes it|docs/_scripts|\bbenchmarks/",
}


def _texts(cell: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, text) for the cell's source and each of its outputs."""
    texts = [("source", "".join(cell["source"]))]
    for output in cell.get("outputs", []):
        if "text" in output:
            texts.append(("output", "".join(output["text"])))
        for kind, value in output.get("data", {}).items():
            if kind.startswith("text/"):
                texts.append((f"output {kind}", "".join(value)))
    return texts


def find_insider_words(cells: list[dict[str, Any]]) -> list[str]:
    """Every forbidden phrase, with the cell and what it is."""
    found = []
    for index, cell in enumerate(cells):
        for where, text in _texts(cell):
            for what, pattern in FORBIDDEN.items():
                for match in re.finditer(pattern, text, re.IGNORECASE):
                    found.append(f"cell {index} {where}: {what}: {match.group(0)!r}")
    return found


@pytest.mark.parametrize("notebook", LESSONS)
def test_lessons_speak_to_readers_in_public_names(notebook: str) -> None:
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    assert find_insider_words(cells) == []


@pytest.mark.parametrize(
    "text",
    [
        "The report helpers of `fsdp_guide.memory._report` put each run next to",
        "from fsdp_guide.wrap._policy import LayerPolicy",
        "Seed 003 (like many tutorials) writes",
        "Redraw it with `python docs/_scripts/make_fsdp_timeline.py`.",
        "tagged `nbval-skip` and `skip-execution`",
        "`python benchmarks/cli_compare.py` refreshes it",
    ],
)
def test_the_search_finds_what_readers_tripped_on(text: str) -> None:
    cell = {"cell_type": "markdown", "source": [text], "metadata": {}}
    assert find_insider_words([cell])


@pytest.mark.parametrize(
    "text",
    [
        "from fsdp_guide.memory import measure_model_state",
        "each rank issues one all-gather per unit",
        "fsdp_guide.wrap.shard(model, engine='fsdp2')",
    ],
)
def test_public_names_and_plain_words_pass(text: str) -> None:
    cell = {"cell_type": "code", "source": [text], "metadata": {}, "outputs": []}
    assert find_insider_words([cell]) == []
