"""What a practitioner asks ``estimate``: where each byte lives, what fits, what it costs.

Each test holds one answer the command gave wrong before: offloaded state counted against the
GPU, HSDP's shard groups fixed at 2, payload mistaken for wire bytes and one reduce
precision for all, columns that did not add up to the total, a fit judged on the total
rather than the step's peak, and the options and names practitioners type.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from fsdp_guide.catalog import STRATEGIES, get_strategy
from fsdp_guide.cli import main
from fsdp_guide.memory import plan
from fsdp_guide.models import TinyTransformer

DEMO = ["estimate", "--model", "fsdp_guide.models:TinyTransformer", "--batch-size", "8"]


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, Any]]:
    assert main([*DEMO, "--json", *args]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return rows


def _first(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each strategy's row of its fullest rank (rank 0 here)."""
    return {r["strategy"]: r for r in rows if r["rank"] == 0}


def test_offloaded_state_is_host_memory_not_gpu_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = _first(
        _json(
            capsys,
            "--world-size",
            "8",
            "--strategy",
            "zero3,deepspeed_zero3_offload,fsdp2,fsdp2_offload",
        )
    )
    on, off = rows["deepspeed_zero3"], rows["deepspeed_zero3_offload"]
    assert off["cpu_offload"] and not on["cpu_offload"]
    # The master copy, its gradient, Adam's state and the parameter shards live in host
    # memory: the GPU holds less than without offload, not more.
    assert off["model_state"] > on["model_state"]  # the offloaded optimizer's own buffers
    assert off["params"] + off["grads"] + off["optimizer"] + off["master"] == 0
    assert (
        off["host"]
        == off["host_master"] + off["host_optimizer"] + off["host_grads"] + off["host_params"]
    )
    assert off["step_peak"] < on["step_peak"] and off["total"] < on["total"]
    # FSDP2's CPUOffloadPolicy: every shard and Adam's state in host memory.
    fsdp2, offloaded = rows["fsdp2"], rows["fsdp2_offload"]
    assert offloaded["host"] == fsdp2["model_state"] == offloaded["model_state"]
    assert offloaded["step_peak"] < fsdp2["step_peak"]


def test_host_memory_must_fit_too(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--world-size", "2", "--strategy", "fsdp2_offload", "--gpu-memory", "80GB"]
    (ample,) = _first(_json(capsys, *args, "--host-memory", "1GB")).values()
    (scarce,) = _first(_json(capsys, *args, "--host-memory", "1MB")).values()
    assert ample["fits"] and not scarce["fits"]


@pytest.mark.parametrize(("world", "per_node", "shard"), [(8, 8, 8), (32, 8, 8), (16, 4, 4)])
def test_hsdp_shards_within_a_node_and_replicates_across_nodes(
    world: int, per_node: int, shard: int
) -> None:
    model = TinyTransformer()
    hsdp = plan(model, batch_size=1, seq_len=32, world_size=world, strategy="hsdp",
                gpus_per_node=per_node)  # fmt: skip
    within = plan(model, batch_size=1, seq_len=32, world_size=shard, strategy="fsdp2")
    assert hsdp.state == within.state  # a node's share, replicated on every node
    groups = hsdp.communication.group_sizes
    assert groups["reduce_scatter"] == groups["all_gather"] == shard
    assert groups["all_reduce"] == world // shard
    # Only the all-reduce across the replicas leaves the node.
    crossing = ("all_reduce",) if world > per_node else ()
    assert hsdp.communication.inter_node == crossing


def test_a_world_that_is_no_whole_number_of_nodes_is_named() -> None:
    from fsdp_guide.errors import PlanError

    with pytest.raises(PlanError, match="not a whole number of nodes of 8 GPUs"):
        plan(TinyTransformer(), batch_size=1, seq_len=32, world_size=12, strategy="hsdp",
             gpus_per_node=8)  # fmt: skip


def test_payload_and_wire_bytes_per_rank_and_the_reduce_precision(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = _first(_json(capsys, "--world-size", "8", "--strategy", "ddp,fsdp2"))
    ddp, fsdp2 = rows["ddp"], rows["fsdp2"]
    # DDP under autocast all-reduces its fp32 gradients: a ring sends 2(g-1)/g of them.
    assert ddp["wire"] == round(ddp["payload"] * 2 * 7 / 8)
    # FSDP2 reduce-scatters in fp32 by default (as examples/fsdp2_train.py sets
    # reduce_dtype) and gathers bf16 parameters: each sends (g-1)/g of its payload.
    model = TinyTransformer()
    fp32 = plan(model, batch_size=8, seq_len=32, world_size=8, strategy="fsdp2", precision="mixed")
    bf16 = plan(model, batch_size=8, seq_len=32, world_size=8, strategy="fsdp2",
                precision="mixed", reduce_dtype="bf16")  # fmt: skip
    scattered = fp32.communication.payload["reduce_scatter"]
    assert fp32.communication.payload_bytes - bf16.communication.payload_bytes == 2 * scattered
    assert fsdp2["payload"] == fp32.communication.payload_bytes
    assert fsdp2["wire"] == round(fsdp2["payload"] * 7 / 8)
    assert main([*DEMO, "--strategy", "fsdp2", "--reduce-dtype", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["payload"] == bf16.communication.payload_bytes


def _table(
    capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[list[str], dict[str, list[str]]]:
    assert main([*DEMO, *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[1].split()
    rows = {c[0]: c for c in (line.split() for line in lines[2:]) if c and c[0] in STRATEGIES}
    return header, rows


def test_every_byte_of_the_total_is_in_a_column(capsys: pytest.CaptureFixture[str]) -> None:
    header, rows = _table(capsys, "--world-size", "8", "--precision", "mixed")
    names = [h for h in header if h not in ("strategy",)]
    added = names[: names.index("total")]
    assert added == [
        "params",
        "grads",
        "optimizer",
        "master",
        "buckets",
        "activations",
        "transient",
    ]
    for name, cells in rows.items():
        values = dict(zip(names, cells[1::2], strict=False))  # numbers; units in between
        units = dict(zip(names, cells[2::2], strict=False))
        scale = {"KB": 1e3, "MB": 1e6, "GB": 1e9}
        total = float(values["total"]) * scale[units["total"]]
        parts = sum(float(values[k]) * scale[units[k]] for k in added)
        assert abs(parts - total) <= 0.01 * scale[units["total"]] * len(added), name
    # DeepSpeed ZeRO-1's fp32 master copy is a column of its own now.
    assert float(rows["deepspeed_zero1"][2 * names.index("master") + 1]) > 0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fits_on_the_step_peak_shown_in_the_table(
    capsys: pytest.CaptureFixture[str], checkpointing: bool
) -> None:
    model = TinyTransformer()
    p = plan(model, batch_size=8, seq_len=32, world_size=2, strategy="fsdp2", precision="mixed",
             activation_checkpointing="blocks" if checkpointing else None)  # fmt: skip
    assert p.step_peak != p.total  # the sum of the columns is not the step's peak
    between = (p.total + p.step_peak) // 2  # one fits, the other does not
    extra = ["--activation-checkpointing"] if checkpointing else []
    header, rows = _table(capsys, "--world-size", "2", "--strategy", "fsdp2", "--gpu-memory",
                          f"{between}B", "--margin", "0", *extra)  # fmt: skip
    assert "peak" in header
    assert rows["fsdp2"][-1] == ("yes" if p.step_peak < p.total else "no")
    assert p.fits(between, 0.0) == (p.step_peak <= between)


def test_max_batch_is_the_largest_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _first(_json(capsys, "--world-size", "2", "--strategy", "fsdp2,ddp", "--gpu-memory",
                        "30MB", "--max-batch"))  # fmt: skip
    model = TinyTransformer()
    for name, row in rows.items():
        best = row["max_batch"]
        at = [plan(model, batch_size=b, seq_len=32, world_size=2, strategy=name,
                   precision="mixed") for b in (best, best + 1)]  # fmt: skip
        assert at[0].fits(30 * 10**6) and not at[1].fits(30 * 10**6), name
    assert rows["fsdp2"]["max_batch"] > rows["ddp"]["max_batch"]


def test_gradient_accumulation_holds_the_gradients_and_reduces_each_micro_batch() -> None:
    model = TinyTransformer()

    def planned(strategy: str, accum: int) -> Any:
        return plan(model, batch_size=4, seq_len=32, world_size=4, strategy=strategy,
                    grad_accumulation=accum)  # fmt: skip

    one, four = planned("fsdp2", 1), planned("fsdp2", 4)
    assert four.communication.payload_bytes == 4 * one.communication.payload_bytes
    assert four.step_peak - one.step_peak == one.state.grads  # the shards held across
    ddp_one, ddp_four = planned("ddp", 1), planned("ddp", 4)  # no_sync: one all-reduce
    assert ddp_four.communication.payload_bytes == ddp_one.communication.payload_bytes


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("fsdp2_no_reshard", {"reshard_after_forward": False}),
        ("fsdp2_offload", {"offload": True}),
    ],
)
def test_what_the_docs_recommend_has_a_name(name: str, settings: dict[str, Any]) -> None:
    spec = get_strategy(name)
    assert spec.engine == "fsdp2" and dict(spec.settings) == settings


@pytest.mark.parametrize(
    ("alias", "name"),
    [("hsdp", "fsdp2_hybrid"), ("zero2", "deepspeed_zero2"), ("zero3", "deepspeed_zero3")],
)
def test_names_people_type(alias: str, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert get_strategy(alias).name == name
    rows = _json(capsys, "--world-size", "2", "--strategy", alias)
    assert rows[0]["strategy"] == name


def test_adamw_has_adams_memory(capsys: pytest.CaptureFixture[str]) -> None:
    adam = _json(capsys, "--world-size", "2", "--strategy", "fsdp2")
    assert main([*DEMO, "--world-size", "2", "--strategy", "fsdp2", "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "adamw, planned as adam" in out
    adamw = _json(capsys, "--world-size", "2", "--strategy", "fsdp2", "--optimizer", "adamw")
    assert adamw == adam


def test_help_names_every_strategy_and_defines_the_columns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["estimate", "--help"]) == 0
    text = capsys.readouterr().out
    for spec in STRATEGIES.values():
        assert f"  {spec.name}" in text, spec.name
    assert "also hsdp" in text and "also zero3" in text
    assert "activations and buffers not included" not in text
    for word in ("payload", "wire", "2(g-1)/g", "peak", "host"):
        assert word in text, word


def test_the_recommendation_names_the_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*DEMO, "--world-size", "2", "--strategy", "ddp,fsdp2", "--gpu-memory",
                 "80GB"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "recommended: ddp" in out or "recommended: fsdp2" in out
    assert "recipe: examples/recipes/" in out


def test_the_docs_define_payload_and_wire() -> None:
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    assert "the ZeRO formulas predict" not in page
    assert "**Payload**" in page and "**Wire**" in page and "2(g-1)/g" in page


TINY_LLAMA = ["--hf", "llama", "--hf-arg", "num_hidden_layers=2", "--hf-arg", "hidden_size=32",
              "--hf-arg", "num_attention_heads=4", "--hf-arg", "num_key_value_heads=2",
              "--hf-arg", "intermediate_size=64", "--hf-arg", "vocab_size=128",
              "--seq-len", "16"]  # fmt: skip


def test_tensor_parallelism_plans_a_transformers_models_own_plan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("transformers")
    args = ["estimate", *TINY_LLAMA, "--world-size", "4", "--tensor-parallel", "2", "--json"]
    assert main(args) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["tensor_parallel"] == 2
    whole = json.loads(_run_json(capsys, ["estimate", *TINY_LLAMA, "--world-size", "2",
                                          "--strategy", "fsdp2", "--json"]))[0]  # fmt: skip
    # The embedding (embedding_rowwise), the head (colwise_gather_output) and every block's
    # projections are cut in two: each rank of a pair keeps about half the state.
    assert row["model_state"] < 0.6 * whole["model_state"]


def _run_json(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    assert main(args) == 0
    return capsys.readouterr().out
