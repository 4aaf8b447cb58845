"""The guide page "Fine-tuning recipes" agrees with the recipes and with ``estimate``.

It reads the page's source: the table from strategy to recipe is what ``estimate`` prints,
every option of every recipe and every key of the DeepSpeed config is explained, and the
page is in the navigation and linked from the pages that lead to it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from recipe_runs import RECIPES, RECIPES_DIR, recipe

from fsdp_guide.catalog import STRATEGIES
from fsdp_guide.cli._recipe import recipe_for

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGE = (DOCS / "guide" / "recipes.md").read_text()
ROW = re.compile(r"^\| (`[^|]+`) \| `([^`]+)` \|", re.MULTILINE)


def table() -> dict[str, str]:
    """Strategy -> the command the page gives for it."""
    rows = {}
    for names, command in ROW.findall(PAGE):
        for name in re.findall(r"`(\w+)`", names):
            rows[name] = command
    return rows


def test_every_strategy_has_the_recipe_estimate_names() -> None:
    rows = table()
    assert set(rows) == set(STRATEGIES)
    for name, command in rows.items():
        named = recipe_for(name).split(" (")[0].replace("<GPUs a node>", "8")
        assert f"examples/recipes/{command}" == named, name


@pytest.mark.parametrize("engine", list(RECIPES))
def test_every_option_of_the_recipe_is_explained(
    engine: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each option of the recipe's ``--help`` starts a term of the page's option lists."""
    with pytest.raises(SystemExit):
        recipe(engine).parse_args(["--help"])
    options = set(re.findall(r"(--[a-z][\w-]+)", capsys.readouterr().out)) - {"--help"}
    explained = {o for o in options if re.search(rf"^`[^\n]*{re.escape(o)}\b", PAGE, re.M)}
    assert options - explained == set()


def test_every_deepspeed_setting_of_the_config_is_explained() -> None:
    config = json.loads((RECIPES_DIR / "deepspeed_zero3.json").read_text())
    zero = set(config["zero_optimization"]) - {"stage", "offload_optimizer", "offload_param"}
    explained = {k for k in zero if re.search(rf"^`[^\n]*{k}\b", PAGE, re.MULTILINE)}
    assert zero - explained == set()


def test_the_page_is_in_the_navigation_and_linked_from_where_readers_come() -> None:
    toctree = (DOCS / "index.md").read_text().split(":caption: Learn", 1)[1].split("```")[0]
    assert "guide/recipes" in toctree.split()
    for page in ("will_it_fit.md", "cluster.md"):
        assert "{doc}`recipes`" in (DOCS / "guide" / page).read_text() or (
            "<recipes>`" in (DOCS / "guide" / page).read_text()
        ), page
    assert "## Then run it" in (DOCS / "guide" / "will_it_fit.md").read_text()
