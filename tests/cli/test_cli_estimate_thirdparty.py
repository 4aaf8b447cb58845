"""``estimate --model`` and ``--hf`` on third-party models: the batch is read from the model.

The builders (tests/helpers/tiny_hf.py) return the transformers model itself, as a user's
would; the command must plan each, say which batch it used, and its ``--json`` must be what
:func:`fsdp_guide.memory.plan` gives for the same model.
"""

from __future__ import annotations

import json

import pytest
import tiny_hf

from fsdp_guide.cli import main
from fsdp_guide.memory import plan

pytest.importorskip("transformers")

STRATEGIES = ("ddp", "fsdp2")
# What each model is fed: its inputs, read from its config, main_input_name and forward.
BATCHES = {
    "gpt2": "input_ids:int64[B,S], labels:int64[B,S]; the model's own loss on its labels",
    "llama": "input_ids:int64[B,S], labels:int64[B,S]; the model's own loss on its labels",
    "bert": "input_ids:int64[B,S], attention_mask:int64[B,S], labels:int64[B,S]; the model's "
    "own loss on its labels",
    "t5": "input_ids:int64[B,S], attention_mask:int64[B,S], decoder_input_ids:int64[B,S], "
    "labels:int64[B,S]; the model's own loss on its labels",
    "vit": "pixel_values:float32[B,3,16,16], labels:int64[B]; the model's own loss on its labels",
    "cnn": "input:float32[B,3,224,224]; cross-entropy over the output's last dimension",
}


@pytest.mark.parametrize("name", list(tiny_hf.BUILDERS))
def test_json_equals_the_python_api_and_names_the_batch(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["estimate", "--model", f"tiny_hf:{name}", "--batch-size", "2", "--seq-len", "16"]
    args += ["--world-size", "2", "--strategy", ",".join(STRATEGIES), "--precision", "fp32"]
    assert main([*args, "--json"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    builder = tiny_hf.BUILDERS[name]
    want = [
        plan(builder, batch_size=2, seq_len=16, world_size=2, strategy=s).as_dict(rank)
        for s in STRATEGIES
        for rank in range(2)
    ]
    assert rows == want
    assert rows[0]["activations"] > 0
    sizes = "B=2, S=16" if name not in ("vit", "cnn") else "B=2"
    # The units line: the cut fsdp2 was planned with (ddp has none), as the rows say it.
    assert [row["units"] for row in rows[::2]] == ["", want[2]["units"]]
    assert captured.err.splitlines() == [
        f"model: {type(builder()).__name__} (tiny_hf:{name}); batch per rank ({sizes}): "
        f"{BATCHES[name]}",
        f"units: {want[2]['units']}, for fsdp2 (--wrap blocks)",
    ]


def test_gpt2_tied_head_counted_once(capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_hf.gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert main(["estimate", "--model", "tiny_hf:gpt2", "--strategy", "ddp", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["num_params"] == sum(p.numel() for p in model.parameters())
    assert row["params"] == 4 * row["num_params"]  # autocast (mixed, the default) keeps fp32
    # the sequence defaults to the model's 64 learned positions
    assert main(["estimate", "--model", "tiny_hf:gpt2", "--seq-len", "65"]) == 2
    assert "longer than GPT2LMHeadModel's 64 learned positions" in capsys.readouterr().err


def test_table_says_which_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "tiny_hf:llama", "--strategy", "fsdp2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [
        f"model: LlamaForCausalLM (tiny_hf:llama); batch per rank (B=1, S=64): {BATCHES['llama']}",
        "units: a unit per LlamaDecoderLayer (2) + the root, for fsdp2 (--wrap blocks)",
    ]


def test_hf_type_and_config_fields_build_the_same_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fields = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
    fields |= {"num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 128}
    fields |= {"max_position_embeddings": 64}
    hf_args = [a for k, v in fields.items() for a in ("--hf-arg", f"{k}={v}")]
    assert main(["estimate", "--hf", "llama", *hf_args, "--strategy", "fsdp2", "--json"]) == 0
    captured = capsys.readouterr()
    want = plan(tiny_hf.llama, batch_size=1, seq_len=64, world_size=8, strategy="fsdp2",
                precision="mixed")  # fmt: skip
    assert json.loads(captured.out)[0] == want.as_dict(0)
    assert captured.err.startswith("model: LlamaForCausalLM (--hf llama);")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hf", "lama"], "unknown transformers model type or class 'lama'; did you mean llama"),
        (["--hf", "llama", "--hf-arg", "hidden_sise=8"], "no field 'hidden_sise'; did you mean"),
        (["--hf", "llama", "--model-arg", "x=1"], "--model-arg is for --model's builder"),
        (["--model", "tiny_hf:gpt2", "--hf-arg", "n_layer=1"], "--hf-arg sets a config field"),
        # A bare model returns hidden states: no loss, no logits, and a clear line, no traceback.
        (["--hf", "T5Model", "--hf-arg", "num_layers=1"], "returned Seq2SeqModelOutput with"),
        (["--model", "tiny_hf:cnn", "--activation-checkpointing"], "has no repeated block"),
        (["--model", "tiny_hf:gpt2", "--input", "ids"], "cannot read 'ids' as an input"),
        # GPT-2's forward swallows unknown keywords (**kwargs) and then misses its input_ids.
        (["--model", "tiny_hf:gpt2", "--input", "x:int64[B,S]"], "ValueError: You have to spec"),
    ],
)
def test_bad_input_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", *args, "--strategy", "ddp"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert message in captured.err


def test_stated_inputs_replace_the_read_ones(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["estimate", "--model", "tiny_hf:bert", "--strategy", "ddp", "--json"]
    assert main(base) == 0
    read = json.loads(capsys.readouterr().out)[0]["activations"]
    # Half the sequence, no mask, no labels: BERT's logits with cross-entropy.
    assert main([*base, "--input", "input_ids:int64[B,32]"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)[0]["activations"] < read
    assert captured.err.strip().endswith("input_ids:int64[B,32]; loss from its output")


MIXTRAL = [
    "--hf",
    "mixtral",
    *("--hf-arg", "num_hidden_layers=1", "--hf-arg", "hidden_size=32"),
    *("--hf-arg", "intermediate_size=64", "--hf-arg", "num_attention_heads=4"),
    *("--hf-arg", "num_key_value_heads=2", "--hf-arg", "vocab_size=96"),
    *("--hf-arg", "num_local_experts=4", "--hf-arg", "num_experts_per_tok=2"),
    *("--world-size", "2", "--strategy", "fsdp2", "--seq-len", "16"),
]


def test_a_mixture_of_experts_is_refused_in_one_line_naming_the_way_out(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # transformers' grouped experts run only in bf16: in fp32 the trace cannot follow them.
    assert main(["estimate", *MIXTRAL, "--precision", "fp32"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert "mixture-of-experts layers (MixtralExperts)" in captured.err
    assert "--activations" in captured.err and "--precision mixed" in captured.err
    assert not captured.out and not [r for r in caplog.records if r.name.startswith("torch")]


def test_stated_activations_plan_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *MIXTRAL, "--activations", "1.5MB", "--json"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert [row["activations"] for row in rows] == [1_500_000, 1_500_000]  # both ranks
    assert rows[0]["total"] > 1_500_000 and rows[0]["params"] > 0
    assert "1,500,000 bytes per rank, as stated (--activations), not traced" in captured.err


def test_stated_activations_need_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7B", "--activations", "1GB"]) == 2
    assert "--activations replaces a real model's traced activations" in capsys.readouterr().err
