"""``python -m fsdp_guide estimate --model``: the plan per strategy, what fits, JSON, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fsdp_guide.catalog import STRATEGIES
from fsdp_guide.cli import main
from fsdp_guide.memory import plan
from fsdp_guide.models import TinyTransformer, TransformerConfig

TINY = ["--model", "fsdp_guide.models:MLP", "--model-arg", "depth=2", "--model-arg", "hidden=64"]


def _rows(out: str) -> dict[str, list[str]]:
    lines = [line.split() for line in out.splitlines()]
    return {cells[0]: cells for cells in lines if cells and cells[0] in STRATEGIES}


def test_every_strategy_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *TINY, "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert list(_rows(out)) == list(STRATEGIES)
    assert "recommended" not in out


def test_json_one_object_per_strategy_and_rank(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model", "fsdp_guide.models:TinyTransformer", "--batch-size", "3"]
    args += ["--strategy", "ddp,zero1", "--json", "--precision", "fp32", "--world-size", "4"]
    assert main([*args, "--activation-checkpointing", "--gpu-memory", "10MB"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["strategy"], r["rank"]) for r in rows] == [
        (name, rank) for name in ("ddp", "zero1") for rank in range(4)
    ]
    want = plan(TinyTransformer(), batch_size=3, seq_len=32, world_size=4, strategy="zero1",
                activation_checkpointing="blocks")  # fmt: skip
    zero1 = rows[4:]
    assert [{k: v for k, v in r.items() if k != "fits"} for r in zero1] == [
        want.as_dict(rank) for rank in range(4)
    ]
    # Whole tensors to each rank: the optimizer shards differ, and so may what fits.
    assert len({r["optimizer"] for r in zero1}) > 1
    assert [r["fits"] for r in zero1] == [want.rank_total(r) <= 9e6 for r in range(4)]
    assert all(isinstance(r[k], int) for r in rows for k in ("params", "activations", "total"))
    assert all(r["units"] == "" for r in rows)  # neither strategy cuts the model into units


def test_a_layer_class_to_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["estimate", "--model", "fsdp_guide.models:TinyTransformer", "--json"]
    base += ["--strategy", "fsdp2"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)[0]["activations"]
    assert main([*base, "--activation-checkpointing", "fsdp_guide.models:Block"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["activations"] < plain


def test_gpu_memory_fits_and_recommends_a_maintained_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = {"vocab_size": 32000, "dim": 4096, "n_heads": 32, "n_layers": 32, "seq_len": 2048}
    args = ["estimate", "--model", f"{__name__}:gpt", "--world-size", "8"]
    args += [a for k, v in cfg.items() for a in ("--model-arg", f"{k}={v}")]
    args += ["--activation-checkpointing", "--gpu-memory", "80GB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["ddp"][-1] == "no"  # 16 bytes x 6.5B parameters do not fit 80 GB
    assert rows["fsdp"][-1] == "yes"
    # torch's ZeroRedundancyOptimizer's step does not fit: under autocast its fp32 gradients
    # are whole on every GPU beside the optimizer step's work. On the wire (ring bytes per
    # GPU), DeepSpeed's ZeRO-3 gathers every block again in backward past
    # stage3_max_reuse_distance, as FSDP2 does, but keeps the last blocks (within that
    # distance) gathered, so it sends a little less; FairScale is no longer developed and
    # FSDP1 is superseded.
    assert rows["zero1"][-1] == "no"
    assert rows["deepspeed_zero3"][-3] == "45.36" and rows["fsdp2"][-3] == "46.53"  # GB
    # FSDP2 without resharding gathers each block once, in forward, and keeps it to its
    # backward: the fewest bytes on the wire of all that fit, at a higher peak.
    assert rows["fsdp2_no_reshard"][-3] == "35.25" and rows["fsdp2_no_reshard"][-1] == "yes"
    assert "recommended: fsdp2_no_reshard (its step's peak fits 80 GB with 10% margin" in out


def gpt(**kwargs: int) -> TinyTransformer:
    """A builder taking dimensions, as --model-arg gives them."""
    return TinyTransformer(TransformerConfig(**kwargs))


def _boom() -> TinyTransformer:
    raise RuntimeError("no such size")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "zero4"], "argument --strategy: unknown strategy 'zero4'"),
        (
            ["--strategy", "ddp,ddp"],
            "argument --strategy: strategy 'ddp' is given twice; name each",
        ),
        (["--gpu-memory", "huge"], "argument --gpu-memory: cannot read 'huge' as a size"),
        (["--gpu-memory", "1e400GB"], "size '1e400GB' is too large"),
        (["--margin", "1.5"], "argument --margin: must be a number from 0 to below 1"),
        (["--model-arg", "80"], "argument --model-arg: must be key=value"),
        (["--model-arg", "hidden=-1"], "the model builder raised RuntimeError"),
        (["--model-arg", "colour=1"], "the model builder raised TypeError"),
        (["--batch-size", "0"], "argument --batch-size: must be an integer from 1 to 1000000000"),
        (["--batch-size", str(2**62), "--seq-len", "4"], "must be an integer from 1 to 1000000000"),
        (["--world-size", str(10**12)], "must be an integer from 1 to 1048576"),
        (["--activation-checkpointing", "torch.nn:Nope"], "--activation-checkpointing takes"),
        (["--activation-checkpointing", "fsdp_guide.models:Block"], "no module of MLP matches"),
    ],
)
def test_bad_input_one_line_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", *TINY, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("fsdp_guide estimate: error: ")
    assert message in captured.err


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("fsdp_guide.models", "argument --model: must be package.module:name"),
        ("no_such_pkg.mod:build", "cannot import 'no_such_pkg.mod'"),
        ("fsdp_guide.models:nothing", "module fsdp_guide.models has no attribute 'nothing'"),
        (f"{__name__}:_boom", "the model builder raised RuntimeError: no such"),
        ("fsdp_guide.models:count_params", "the model builder raised TypeError"),
    ],
)
def test_bad_model_one_line_exit_2(
    model: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", "--model", model]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert message in captured.err


def test_params_and_model_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7B", *TINY]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_module_entry_point() -> None:
    cmd = [sys.executable, "-m", "fsdp_guide", "estimate", *TINY, "--strategy", "fsdp", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["strategy"] == "fsdp"
