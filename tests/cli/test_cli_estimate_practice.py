"""``estimate --grad-accum``, ``--sync-each-micro-step`` and ``--trainable``: the plan's
figures on the command line, the options in ``--help``, one-line errors with exit 2."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fsdp_guide.cli import main
from fsdp_guide.memory import plan
from fsdp_guide.models import TinyTransformer, TransformerConfig

HF = ["--hf", "llama"] + [
    a
    for k, v in {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 128,
        "max_position_embeddings": 64,
    }.items()
    for a in ("--hf-arg", f"{k}={v}")
]
TINY = ["--model", "fsdp_guide.models:TinyTransformer"]


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[dict[str, Any]]:
    assert main(["estimate", *argv, "--json"]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return rows


def test_help_documents_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for option in ("--grad-accum K", "--sync-each-micro-step", "--trainable SPEC"):
        assert option in out
    assert "lora:r=R" in out and "set_requires_gradient_sync(False)" in out


@pytest.mark.parametrize("sync", [False, True])
def test_grad_accum_is_the_plans_accumulation(
    capsys: pytest.CaptureFixture[str], sync: bool
) -> None:
    flags = ["--sync-each-micro-step" if sync else "--no-sync-each-micro-step"]
    argv = [*TINY, "--world-size", "2", "--precision", "fp32", "--grad-accum", "4", *flags]
    rows = _json(capsys, argv)
    assert sorted({r["strategy"] for r in rows}) == ["ddp", "fsdp", "fsdp2"]
    want = plan(
        TinyTransformer(TransformerConfig()),
        batch_size=1,
        seq_len=32,
        world_size=2,
        strategy="fsdp2",
        grad_accumulation=4,
        sync_each_micro_step=sync,
    )
    assert want.accumulation is not None
    row = next(r for r in rows if r["strategy"] == "fsdp2")
    assert row["held_between_micro_steps"] == want.accumulation.held[0]
    assert row["communication_per_optimizer_step"] == sum(want.accumulation.payload_bytes.values())


def test_trainable_patterns_freeze_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*TINY, "--world-size", "2", "--trainable", "blocks.3.*,head.*", "--precision", "fp32"]
    rows = _json(capsys, argv)
    assert sorted({r["strategy"] for r in rows}) == ["ddp", "fsdp2"]
    model = TinyTransformer(TransformerConfig())
    trainable = sum(
        p.numel() for n, p in model.named_parameters() if n.startswith(("blocks.3.", "head."))
    )
    assert {r["trainable_params"] for r in rows} == {trainable}
    fsdp2 = next(r for r in rows if r["strategy"] == "fsdp2")
    assert fsdp2["grads"] == 4 * trainable // 2  # rows of 128 or 256: no padding on 2 ranks


def test_lora_adapters_from_peft(capsys: pytest.CaptureFixture[str]) -> None:
    peft = pytest.importorskip("peft")
    assert main(["estimate", *HF, "--world-size", "2", "--trainable", "lora:r=4"]) == 0
    out = capsys.readouterr().out
    from fsdp_guide.hf import hf_builder

    kwargs = {a.split("=")[0]: int(a.split("=")[1]) for a in HF[3::2]}
    model = peft.get_peft_model(hf_builder("llama", kwargs)(), peft.LoraConfig(r=4))
    trainable, total = model.get_nb_trainable_parameters()
    assert f"trainable: {trainable:,} of {total:,} parameters" in out


BAD = {
    "--grad-accum 0": (["--grad-accum", "0"], "--grad-accum: must be an integer from 1"),
    "--grad-accum x": (["--grad-accum", "x"], "--grad-accum: must be an integer from 1"),
    "--grad-accum with --params": (["--grad-accum", "2"], "--grad-accum needs a real model"),
    "--trainable with --params": (["--trainable", "head.*"], "--trainable needs a real model"),
    "sync without accumulation": (
        [*TINY, "--sync-each-micro-step"],
        "--sync-each-micro-step says when K micro-steps reduce",
    ),
    "lora rank 0": (["--trainable", "lora:r=0"], "must be lora:r=R[,targets=A+B] with R >= 1"),
    "lora garbage": (["--trainable", "lora:rank"], "must be lora:r=R"),
    "empty patterns": (["--trainable", ","], "must be lora:r=R or parameter-name patterns"),
    "patterns matching nothing": (
        [*TINY, "--trainable", "nothing.*"],
        "matches no parameter of TinyTransformer",
    ),
    "frozen under fsdp": (
        [*TINY, "--trainable", "head.*", "--strategy", "fsdp"],
        "frozen parameters are planned for ddp and fsdp2",
    ),
    "sync under oss": (
        [*TINY, "--grad-accum", "2", "--sync-each-micro-step", "--strategy", "oss"],
        "sync_each_micro_step=True is planned for ddp, fsdp1, fsdp2",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_values_are_one_line_and_exit_2(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv, message = BAD[case]
    if "--model" not in argv:
        argv = ["--params", "7e9", *argv]
    assert main(["estimate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("fsdp_guide estimate: error: ")
    assert message in captured.err, captured.err
