"""``estimate`` names, under its recommendation, the recipe of ``examples/recipes`` to run.

Every strategy of the catalog maps to a recipe that exists, with options that recipe
accepts; the command line prints it for the strategy it recommends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_runs import RECIPES, recipe

from fsdp_guide.catalog import STRATEGIES
from fsdp_guide.cli import main
from fsdp_guide.cli._recipe import HANDLED_SETTINGS, recipe_for

ROOT = Path(__file__).resolve().parents[2]
ENGINE_OF = {f"{module}.py": engine for engine, module in RECIPES.items()}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_strategy_names_a_recipe_that_accepts_its_options(strategy: str) -> None:
    # A new catalog row with a setting the mapping does not know would get a recipe that
    # ignores it: add the setting's option to recipe_for, then here.
    assert set(STRATEGIES[strategy].settings) <= HANDLED_SETTINGS
    command = recipe_for(strategy).split(" (")[0].replace("<GPUs a node>", "8").split()
    script, options = Path(command[0]), command[1:]
    assert script.parent == Path("examples/recipes") and (ROOT / script).is_file()
    args = recipe(ENGINE_OF[script.name]).parse_args(options)  # exits on an unknown option
    spec = STRATEGIES[strategy]
    if ENGINE_OF[script.name] == "deepspeed_zero3":
        assert (args.zero_stage or 3) == spec.zero_stage
        assert args.offload_optimizer == bool(spec.settings.get("offload_optimizer"))
        assert args.offload_params == bool(spec.settings.get("offload_params"))
    if ENGINE_OF[script.name] == "fsdp2":
        hybrid = "shard_group" in spec.settings or "HYBRID" in str(spec.settings)
        assert (args.gpus_per_node == 8) == hybrid
    if spec.engine in ("ddp", "fsdp2", "deepspeed"):
        assert "(" not in recipe_for(strategy)  # its own engine: nothing to say


@pytest.mark.parametrize(
    ("strategy", "recipe_line"),
    [
        ("deepspeed_zero3", "recipe: examples/recipes/deepspeed_zero3_finetune.py"),
        ("fsdp2", "recipe: examples/recipes/fsdp2_finetune.py"),
        ("ddp", "recipe: examples/recipes/ddp_finetune.py"),
    ],
)
def test_estimate_prints_the_recipe_of_what_it_recommends(
    capsys: pytest.CaptureFixture[str], strategy: str, recipe_line: str
) -> None:
    args = ["estimate", "--model", "fsdp_guide.models:TinyTransformer", "--world-size", "2"]
    assert main([*args, "--strategy", strategy, "--gpu-memory", "80GB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("recommended: "))
    assert lines[at].startswith(f"recommended: {strategy} ")
    assert lines[at + 1] == recipe_line


def test_no_recipe_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model", "fsdp_guide.models:TinyTransformer", "--gpu-memory", "1KB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "recommended: none fits" in out and "recipe:" not in out
