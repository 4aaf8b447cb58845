"""One strategy vocabulary: the catalog, and every part of the package reading it."""

from __future__ import annotations

import re

import pytest

import fsdp_guide.catalog as catalog
from fsdp_guide.catalog import STRATEGIES, check_strategies, get_strategy, resolve_stage
from fsdp_guide.cli import build_parser, main
from fsdp_guide.memory import estimate_model_state

ALL_NAMES = [name for spec in STRATEGIES.values() for name in (spec.name, *spec.aliases)]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_every_name_and_alias_is_a_stage_everywhere(name: str) -> None:
    spec = get_strategy(name)
    assert resolve_stage(name) == spec.zero_stage
    # The formulas take the same names (they used to refuse zero3 and every FSDP1 variant).
    assert estimate_model_state(1000, 2, name) == estimate_model_state(1000, 2, spec.zero_stage)


@pytest.mark.parametrize(("stage", "number"), [(0, 0), (3, 3), ("zero0", 0), ("zero3", 3)])
def test_numbers_and_zero_names(stage: int | str, number: int) -> None:
    assert resolve_stage(stage) == number


@pytest.mark.parametrize("bad", [4, -1, True, "zero4", "3", "FSDP", None])
def test_unknown_stage_names_the_choices(bad: object) -> None:
    with pytest.raises(ValueError, match="use 0-3, zero0-zero3 or a strategy: ddp, zero1"):
        resolve_stage(bad)  # type: ignore[arg-type]


def test_names_are_unique_across_names_and_aliases() -> None:
    assert len(ALL_NAMES) == len(set(ALL_NAMES))


def test_each_strategy_is_its_own_engine_and_settings() -> None:
    from fsdp_guide.engines import engine_for

    engines = [engine_for(name) for name in STRATEGIES]
    assert len(set(engines)) == len(engines)  # two rows building the same thing is one row


def test_stage_at_step_differs_only_where_documented() -> None:
    from fsdp_guide.engines import engine_for

    differ = {n for n, s in STRATEGIES.items() if engine_for(n).stage_at_step != s.zero_stage}
    assert differ == {"fsdp_grad_op"}


def test_variants_name_a_row_of_the_same_engine_and_stage() -> None:
    variants = {s.name: s.variant_of for s in STRATEGIES.values() if s.variant_of}
    assert set(variants) == {
        "sharded_ddp_buckets",
        "fsdp_hybrid",
        "fsdp2_hybrid",
        "fsdp2_no_reshard",
        "fsdp2_offload",
        "deepspeed_zero2_offload",
        "deepspeed_zero3_offload",
    } - ({"fsdp2_hybrid"} - set(STRATEGIES))
    for name, base in variants.items():
        assert base is not None
        assert (STRATEGIES[name].engine, STRATEGIES[name].zero_stage) == (
            STRATEGIES[base].engine,
            STRATEGIES[base].zero_stage,
        )


def test_the_catalog_is_a_leaf() -> None:
    """It imports nothing of the package but errors, so everything may read it."""
    import ast
    from pathlib import Path

    imported = set()
    for path in Path(catalog.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_guide"):
                imported.add(node.module)
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name.startswith("fsdp_guide")}
    assert {m for m in imported if not m.startswith("fsdp_guide.catalog")} == {"fsdp_guide.errors"}


def test_aliases_resolve_to_the_canonical_spec_and_are_not_repeats() -> None:
    assert [s.name for s in check_strategies(["zero", "fsdp1", "fsdp2"])] == [
        "zero1",
        "fsdp",
        "fsdp2",
    ]
    with pytest.raises(ValueError, match=r"'zero1' is given twice \(as 'zero'\)"):
        check_strategies(["zero1", "zero"])


def test_cuda_only_strategies_are_refused_without_cuda_and_kept_with_it() -> None:
    cuda_only = [s.name for s in STRATEGIES.values() if s.needs_cuda]
    assert cuda_only == ["fairscale_fsdp"]
    assert [s.name for s in check_strategies(cuda_only, cuda=True)] == cuda_only
    with pytest.raises(ValueError, match="needs CUDA"):
        check_strategies(cuda_only, cuda=False)


def _docstring_rows() -> dict[str, tuple[int, str]]:
    doc = catalog.__doc__ or ""
    rows = re.findall(r"^``(\w+)``(?: \(``\w+``\))?\s+(\d)\s+(\w+)\s", doc, flags=re.M)
    return {name: (int(stage), engine) for name, stage, engine in rows}


def test_the_documented_table_is_the_table() -> None:
    expected = {s.name: (s.zero_stage, s.engine) for s in STRATEGIES.values()}
    assert _docstring_rows() == expected


def test_compare_help_lists_every_strategy_and_accepts_aliases(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["compare", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for name in STRATEGIES:
        assert name in help_text
    args = build_parser().parse_args(["compare", "--strategies", "fsdp1,zero"])
    assert args.strategies == ["fsdp", "zero1"]


def test_estimate_lists_the_catalog_names_per_stage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "1e9"]) == 0
    out = capsys.readouterr().out
    for spec in STRATEGIES.values():
        if spec.variant_of:
            continue  # variants of a listed mechanism
        line = next(ln for ln in out.splitlines() if ln.startswith(str(spec.zero_stage) + " "))
        assert spec.name in line.split("  ")[2] or f" {spec.name}" in line


def test_checkpoint_names_are_the_catalog_engines() -> None:
    from typing import get_args

    from fsdp_guide.catalog import EngineName
    from fsdp_guide.engines import ENGINES

    # Every engine the rows may name has an adapter, and "module" is a model none wrapped.
    assert {"module", *get_args(EngineName)} == {e.name for e in ENGINES}


def _detected_engines(rank: int, world_size: int, names: list[str]) -> dict[str, str]:
    from fsdp_guide.engines import engine_for, wrap_for_strategy
    from fsdp_guide.models import build_model

    detected = {}
    for name in names:
        model, optimizer = wrap_for_strategy(build_model("mlp"), name, world_size)
        detected[name] = engine_for(model, optimizer).name
    return detected


@pytest.mark.slow
def test_detect_names_the_engine_of_every_cpu_strategy() -> None:
    from fsdp_guide import launch

    cpu = [name for name, spec in STRATEGIES.items() if not spec.needs_cuda]
    detected = launch(
        _detected_engines, 2, args=(cpu,), backend="gloo", start_method="fork", timeout=120
    )[0]
    assert detected == {name: STRATEGIES[name].engine for name in cpu}
