"""The choosing guide recommends engines their authors still develop, and says why the others
are still taught."""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "choosing.md"
# FairScale's classes and the Lightning strategy built on them: taught, not recommended.
UNMAINTAINED = ("DDPShardedStrategy", "ShardedDDP", "OSS", "FairScale", "sharded_ddp")


def _start_with_column() -> list[str]:
    """The "Start with" cell of every row of the table of situations."""
    rows = [line for line in GUIDE.read_text().splitlines() if line.startswith("| ")]
    header = next(i for i, line in enumerate(rows) if "Start with" in line)
    column = [c.strip() for c in rows[header].strip("|").split("|")].index("Start with")
    return [[c.strip() for c in row.strip("|").split("|")][column] for row in rows[header + 1 :]]


def test_every_situation_starts_with_a_maintained_engine() -> None:
    cells = _start_with_column()
    assert len(cells) >= 4
    new_code = [c for c in cells if "Existing code" not in c and "migration" not in c]
    for cell in new_code:
        assert not any(re.search(rf"\b{name}\b", cell) for name in UNMAINTAINED), cell
    assert any("FSDP2" in cell for cell in cells)


def test_the_guide_says_why_the_other_engines_are_taught() -> None:
    text = GUIDE.read_text()
    assert "Why the lessons still teach FairScale and FSDP1" in text
    assert "fully_shard" in text
