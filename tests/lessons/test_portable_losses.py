"""A loss compared across two layouts is compared with a tolerance, never bit for bit.

Two layouts of the same training (plain TP and TP with sequence parallelism, a 2-D mesh and
one process) add the same numbers in different orders; on another CPU, or with another
number of threads, the last bits differ, and a stored "True" from ``==`` turns "False"
there. Every checked cell of lessons 11-14 that prints a verdict about losses must compute
it with a stated tolerance (``allclose``, ``isclose`` or an explicit bound).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LESSONS = sorted(p.name for p in NOTEBOOKS.glob("1[1-4]_*.ipynb"))
TOLERANCE = re.compile(r"allclose|isclose|rtol|rel_tol|abs\([^)]*\)\s*<")
VERDICT = re.compile(r"^.*\bloss(?:es)?\b.*:\s*(?:True|False)\s*$", re.MULTILINE | re.IGNORECASE)


def loss_verdicts_without_tolerance(cells: list[dict[str, Any]]) -> list[str]:
    """Checked cells that print a True/False about losses without any tolerance in their code."""
    found = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        printed = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
        source = "".join(cell["source"])
        if VERDICT.search(printed) and not TOLERANCE.search(source):
            found.append(f"cell {index}: {VERDICT.search(printed).group(0).strip()!r}")
    return found


@pytest.mark.parametrize("notebook", LESSONS)
def test_loss_verdicts_are_computed_with_a_tolerance(notebook: str) -> None:
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    assert loss_verdicts_without_tolerance(cells) == []


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ('print("losses equal:", [r["losses"] for r in a] == [r["losses"] for r in b])', True),
        ('print("TP+SP losses equal TP\'s:", torch.allclose(x, y, rtol=1e-5, atol=0))', False),
        ('print("same third step:", abs(loss - reference) < 1e-5 * reference)', False),
    ],
)  # fmt: skip
def test_the_check_finds_an_exact_comparison(source: str, flagged: bool) -> None:
    cell = {
        "cell_type": "code",
        "source": source,
        "outputs": [{"name": "stdout", "text": source.split('"')[1] + " True\n"}],
    }
    assert bool(loss_verdicts_without_tolerance([cell])) is flagged
