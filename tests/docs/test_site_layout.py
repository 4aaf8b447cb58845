"""The built site in a real browser (headless Chromium) at 1280 px and at a phone's 390 px.

What a reader saw clipped: lesson 04's comparison table cut at "pred…", the "will it fit"
table without its ``recommended`` column, the CLI page without its ``fits`` column, outputs
scrolling sideways, module names in the side navigation broken mid-word, and on a phone the
landing page's PyTorch column off-screen. ``tests/helpers/site_layout.py`` does the
measuring; run it alone to count every page (``python tests/helpers/site_layout.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import site_layout
from test_docs_site import site  # noqa: F401  (the fixture that builds the site)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(site_layout.chromium() is None, reason="needs Chromium (apt: chromium)"),
]

LESSON_04 = "notebooks/04_fully_sharded_data_parallel.html"
# Lessons 01 to 05 in the lesson shape: their figures and key tables, at both widths.
LESSONS_01_05 = [
    "notebooks/01_launching_multi_process_cells.html",
    "notebooks/02_optimizer_state_sharding.html",
    "notebooks/03_sharded_ddp.html",
    "notebooks/05_wrapping_policies.html",
]
COMPARISON = "strategy | ZeRO | rank | params | grads | optimizer | measured | predicted"
# Lessons 06-10, each with the header of its measured-next-to-predicted table (09 is a key page).
LESSON_TABLES = {
    "notebooks/06_activation_checkpointing.html": "run | rank | ckpt | activations | planned",
    "notebooks/07_lightning_strategies.html": "strategy | rank | params | grads | buckets",
    "notebooks/08_ddp_optimizations.html": "setting | rank | sent / step | predicted",
    "notebooks/09_deepspeed_zero.html": "run | params | master | grads | buckets | Adam",
    "notebooks/10_lightning_fsdp_strategies.html": "sharding | ranks | rank | params in flight",
}
# Lessons 11-14: their figures, tables and printed outputs, at a laptop's and a phone's width.
LESSON_11 = "notebooks/11_building_and_loading_big_models.html"
LESSON_12 = "notebooks/12_sharded_checkpoints.html"
LESSONS_11_TO_14 = [
    LESSON_11,
    LESSON_12,
    "notebooks/13_one_step_in_time.html",
    "notebooks/14_beyond_data_parallelism.html",
]
PAGES = [
    *site_layout.KEY_PAGES,
    "api/fsdp_guide.launcher.magic.html",
    *LESSONS_01_05,
    *(page for page in LESSON_TABLES if page not in site_layout.KEY_PAGES),
    *LESSONS_11_TO_14,
]


@pytest.fixture(scope="module")
def layouts(site: Path) -> dict[tuple[str, int], site_layout.Layout]:  # noqa: F811
    found = site_layout.measure(site, PAGES)
    return {(x.page, x.width): x for x in found}


@pytest.mark.parametrize("name", PAGES)
def test_no_output_scrolls_sideways_at_1280(layouts: dict, name: str) -> None:
    assert layouts[name, 1280].scrolling == []


@pytest.mark.parametrize(
    ("name", "header"),
    [
        *((page, COMPARISON) for page in [*LESSONS_01_05[1:], LESSON_04]),
        (LESSONS_01_05[0], "rank | parameter bytes"),
        ("guide/will_it_fit.html", "model |"),  # the table with the recommended column
        *LESSON_TABLES.items(),
        (LESSON_11, "method | peak, rank 0 | peak, rank 1 | predicted"),
        (LESSON_12, "checkpoint | written, rank 0 | written, rank 1 | predicted"),
    ],
)
def test_named_tables_fit_at_1280(layouts: dict, name: str, header: str) -> None:
    assert not [t for t in layouts[name, 1280].tables if t.startswith(header)]


def test_cli_output_keeps_its_fits_column_on_screen(layouts: dict, site: Path) -> None:  # noqa: F811
    assert "fits" in (site / "cli.html").read_text(encoding="utf-8")
    assert layouts["cli.html", 1280].scrolling == []


@pytest.mark.parametrize("width", site_layout.WIDTHS)
@pytest.mark.parametrize("name", PAGES)
def test_no_page_is_wider_than_the_screen(layouts: dict, name: str, width: int) -> None:
    layout = layouts[name, width]
    assert not layout.page_scrolls and layout.offscreen == [], layout.offscreen[:5]


def test_landing_page_tables_fit_a_phone(layouts: dict) -> None:
    assert layouts["index.html", 390].tables == []


@pytest.mark.parametrize("name", ["api/index.html", "api/fsdp_guide.launcher.magic.html"])
def test_navigation_breaks_names_only_after_a_dot(layouts: dict, name: str) -> None:
    assert layouts[name, 1280].midword == []


def test_the_checks_find_each_defect(tmp_path: Path) -> None:
    """The same probe over a page with each defect finds all of them."""
    (tmp_path / "bad.html").write_text(
        "<html><head><meta name='viewport' content='width=device-width'></head><body>"
        "<nav class='bd-links'><a href='#' style='display:block;width:60px;"
        "overflow-wrap:anywhere'>"
        "fsdp_guide.launcher.magic</a></nav><article class='bd-article' style='width:300px'>"
        "<div class='cell_output'><pre style='overflow:auto'>" + "x" * 200 + "</pre></div>"
        "<table><tr><th>" + "</th><th>".join(["column"] * 12) + "</th></tr></table>"
        "<div style='width:900px'>wide</div></article></body></html>"
    )
    (found,) = site_layout.measure(tmp_path, ["bad.html"], widths=(390,))
    assert found.scrolling and found.tables and found.page_scrolls and found.midword
