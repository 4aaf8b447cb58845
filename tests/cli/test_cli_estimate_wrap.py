"""``estimate --wrap``: the units of the fully sharded strategies, as ``plan(policy=)`` cuts them.

Each form (``blocks``, ``root``, ``min_params=N``, layer classes) must give what
:func:`fsdp_guide.memory.plan` gives with the matching policy, on the demo transformer and on
a transformers model, and the output must say which units were planned.
"""

from __future__ import annotations

import json

import pytest
import tiny_hf
from torch import nn

from fsdp_guide.cli import main
from fsdp_guide.engines import UnitPolicy, UnitRule, unit_names
from fsdp_guide.memory import Plan, build_on_meta, plan
from fsdp_guide.models import Block, TinyTransformer
from fsdp_guide.wrap import LayerPolicy, SizePolicy

pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

TINY = "fsdp_guide.models:TinyTransformer"
LLAMA_LAYER = "transformers.models.llama.modeling_llama:LlamaDecoderLayer"
SIZES = ["--batch-size", "2", "--seq-len", "16", "--world-size", "2", "--precision", "fp32"]
STRATEGIES = ("ddp", "fsdp", "fsdp2")


def _figures(p: Plan) -> dict[str, int | str | bool]:
    return {k: v for k, v in p.as_dict().items() if k != "units"}


def _never_built() -> nn.Module:
    raise RuntimeError("the model was built")


@pytest.mark.parametrize(
    ("model", "wrap", "policy"),
    [
        (TINY, [], "blocks"),
        (TINY, ["--wrap", "blocks"], "blocks"),
        (TINY, ["--wrap", "root"], "root"),
        (TINY, ["--wrap", "min_params=1e4"], SizePolicy(min_num_params=10_000)),
        (TINY, ["--wrap", "min_params=10k"], SizePolicy(min_num_params=10_000)),
        (TINY, ["--wrap", "fsdp_guide.models:Block"], LayerPolicy(Block)),
        (
            TINY,
            ["--wrap", "fsdp_guide.models:Block, torch.nn:Embedding"],
            LayerPolicy(Block, nn.Embedding),
        ),
        ("tiny_hf:llama", ["--wrap", "root"], "root"),
        ("tiny_hf:llama", ["--wrap", "min_params=2K"], SizePolicy(min_num_params=2_000)),
        ("tiny_hf:llama", ["--wrap", LLAMA_LAYER], LayerPolicy(LlamaDecoderLayer)),
    ],
)
def test_json_equals_plan_with_the_policy(
    model: str,
    wrap: list[str],
    policy: UnitRule | UnitPolicy,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["estimate", "--model", model, *SIZES, "--strategy", ",".join(STRATEGIES), *wrap]
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    builder = TinyTransformer if model == TINY else tiny_hf.llama
    plans = {
        s: plan(builder, batch_size=2, seq_len=16, world_size=2, strategy=s, policy=policy)
        for s in STRATEGIES
    }
    assert rows == [plans[s].as_dict(rank) for s in STRATEGIES for rank in range(2)]
    assert rows[0]["units"] == ""  # DDP keeps the model whole
    assert rows[2]["units"] == plans["fsdp"].units != ""
    # The figures follow the units: those of the default cut unless the policy makes the
    # same units (a unit per block).
    default = plan(builder, batch_size=2, seq_len=16, world_size=2, strategy="fsdp2")
    meta = build_on_meta(builder)
    same_units = unit_names(meta, policy) == unit_names(meta)
    assert (_figures(plans["fsdp2"]) == _figures(default)) == same_units


def test_root_gathers_the_whole_model(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model", TINY, *SIZES, "--strategy", "fsdp,fsdp2", "--json"]
    assert main(args) == 0
    blocks = json.loads(capsys.readouterr().out)
    assert main([*args, "--wrap", "root"]) == 0
    root = json.loads(capsys.readouterr().out)
    for by_blocks, whole in zip(blocks, root, strict=True):
        # One unit: its gathered parameters and gradients are the whole model's.
        assert whole["transient"] > by_blocks["transient"]
        assert whole["transient"] == 2 * 4 * whole["num_params"]  # fp32 params + grads
        assert whole["units"] == "the whole model (root)"
        assert whole["params"] == by_blocks["params"]
    # FSDP1's Adam keeps a step per flat parameter, one per unit; FSDP2's one per tensor.
    units = len(unit_names(TinyTransformer())) + 1
    assert blocks[0]["optimizer"] - root[0]["optimizer"] == 4 * (units - 1)
    assert blocks[2]["optimizer"] == root[2]["optimizer"]


@pytest.mark.parametrize(
    ("model", "wrap", "policy", "units"),
    [
        (TINY, [], "blocks", "a unit per Block (4) + the root"),
        (TINY, ["--wrap", "root"], "root", "the whole model (root)"),
        (
            TINY,
            ["--wrap", "min_params=1e4"],
            SizePolicy(min_num_params=10_000),
            "a unit per module of >= 10,000 parameters not in a smaller unit: Embedding (1), "
            "Linear (17) + the root",
        ),
        (
            "tiny_hf:llama",
            ["--wrap", LLAMA_LAYER],
            LayerPolicy(LlamaDecoderLayer),
            "a unit per LlamaDecoderLayer (2) + the root",
        ),
    ],
)
def test_table_says_which_units(
    model: str,
    wrap: list[str],
    policy: UnitRule | UnitPolicy,
    units: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["estimate", "--model", model, *SIZES, "--strategy", "ddp,fsdp2", *wrap]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    builder = TinyTransformer if model == TINY else tiny_hf.llama
    want = plan(builder, batch_size=2, seq_len=16, world_size=2, strategy="fsdp2", policy=policy)
    assert want.units == units
    # Right after the line that says which batch was planned.
    assert out[-2].startswith("model: ")
    assert out[-1] == f"units: {units}, for fsdp2 (--wrap {wrap[1] if wrap else 'blocks'})"


def test_hf_model_with_a_layer_class(capsys: pytest.CaptureFixture[str]) -> None:
    hf = ["--hf", "gpt2", "--hf-arg", "n_layer=2", "--hf-arg", "n_embd=32"]
    hf += ["--hf-arg", "n_head=2", "--hf-arg", "vocab_size=128", "--hf-arg", "n_positions=64"]
    layer = "transformers.models.gpt2.modeling_gpt2:GPT2Block"
    args = ["estimate", *hf, *SIZES, "--strategy", "fsdp", "--json", "--wrap", layer]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    want = plan(tiny_hf.gpt2, batch_size=2, seq_len=16, world_size=2, strategy="fsdp",
                policy=LayerPolicy(GPT2Block))  # fmt: skip
    assert rows == [want.as_dict(rank) for rank in range(2)]
    assert rows[0]["units"] == "a unit per GPT2Block (2) + the root"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--wrap", "min_params=0"], "argument --wrap: min_params=N takes a whole count of at"),
        (["--wrap", "min_params=x"], "argument --wrap: min_params=N takes a whole count of at"),
        (["--wrap", "min_params=1.5"], "min_params=N takes a whole count of at least 1"),
        (["--wrap", "Block"], "argument --wrap: must be blocks, root, min_params=N"),
        (["--wrap", "nope:Nope"], "--wrap nope:Nope: cannot import 'nope'"),
        (["--wrap", "os:path"], "--wrap os:path: os.path is a module, not an nn.Module class"),
        (["--wrap", "torch.nn:Nope"], "module torch.nn has no attribute 'Nope'"),
        (["--wrap", "root", "--strategy", "ddp,zero1"], "--strategy ddp,zero1 has none of them"),
    ],
)
def test_bad_wrap_before_the_model_is_built(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", "--model", f"{__name__}:_never_built", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert message in captured.err
    assert "blocks, root, min_params=N" in captured.err or "--strategy" in message
    assert "the model was built" not in captured.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "7B", "--wrap", "root"], "--wrap needs a real model (--model"),
        (["--params", "7B", "--wrap", "min_params=0"], "argument --wrap: min_params=N takes"),
        (
            ["--model", TINY, "--wrap", "torch.nn:Conv2d"],
            "no module of TinyTransformer is a Conv2d; name a class it holds (its blocks: Block)",
        ),
    ],
)
def test_wrap_needs_a_model_that_has_the_units(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert message in captured.err
