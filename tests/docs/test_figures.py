"""Lesson figures are drawn by code in the repository, and readable on a phone.

``docs/_scripts/figures/make_figures.py`` draws every file of ``notebooks/figures/``; each
committed SVG must be exactly what its code draws now (so a figure is redrawn when the idea it
shows changes), and its smallest label must stay legible at a phone's page width.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "docs" / "_scripts" / "figures"
FIGURES = REPO / "notebooks" / "figures"
sys.path.insert(0, str(SCRIPTS))

from style import MIN_PHONE_PX, smallest_phone_px  # noqa: E402


def _drawn() -> list[str]:
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "make_figures.py"), "--list"],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.split()


def test_every_committed_figure_is_what_its_code_draws() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "make_figures.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr


def test_every_lesson_figure_is_drawn_by_code() -> None:
    committed = sorted(p.name for p in FIGURES.glob("*.svg"))
    assert sorted(set(committed) - set(_drawn())) == []


@pytest.mark.parametrize("name", sorted(p.name for p in FIGURES.glob("*.svg")))
def test_labels_are_legible_on_a_phone(name: str) -> None:
    assert smallest_phone_px((FIGURES / name).read_text()) >= MIN_PHONE_PX
