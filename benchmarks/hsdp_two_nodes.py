"""HSDP on two "nodes": the bytes of each collective, within a node and across nodes, vs prediction.

Two torchrun agents on this machine, two gloo ranks each, run ``examples/fsdp2_hsdp.py`` twice:
sharded within each node and replicated across the two (HSDP, mesh (2, 2)), and sharded over
all four ranks (a 1-D mesh: plain FSDP2 across both nodes). Rank 0's collectives of one step,
counted per process group, are set beside the prediction; then the same prediction for a 7B
model on two nodes of eight GPUs says which collectives a real cluster sends over its network.

The prediction for HSDP is the planner's ``fsdp2_hybrid`` (FSDP2 on a (replicate, shard) mesh
in pairs; see ``tests/helpers/hsdp_reference.py``).

Usage::

    python benchmarks/hsdp_two_nodes.py [--out benchmarks/results/hsdp_two_nodes.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
from hsdp_reference import FP32, LAYERS, Model, hsdp_prediction  # noqa: E402
from torchrun_nodes import run_nodes  # noqa: E402

from fsdp_guide.comm import predict_communication  # noqa: E402
from fsdp_guide.memory import format_bytes, plan  # noqa: E402

EXAMPLE = ROOT / "examples" / "fsdp2_hsdp.py"
PSI_7B = 6_738_415_616  # parameters of a Llama-2-7B-sized model
NODES, GPUS = 2, 8


def two_nodes(shard_size: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "ranks.json"
        run_nodes(EXAMPLE, ["--steps", "2", "--shard-size", str(shard_size), "--json", str(report)])
        ranks: list[dict[str, Any]] = json.loads(report.read_text())
    return ranks


def fsdp_prediction(world: int) -> dict[tuple[str, str], tuple[int, int]]:
    """FSDP2 over every rank of both nodes: its groups span the nodes."""
    model = Model()
    psi = sum(p.numel() for p in model.parameters())
    root = psi - sum(p.numel() for p in model.blocks.parameters())
    payload = predict_communication("fsdp2", psi, world, "fp32", root_unit_params=root).payload
    units = LAYERS + 1
    return {
        ("across nodes", "all_gather"): (2 * units - 1, payload["all_gather"] * FP32),
        ("across nodes", "reduce_scatter"): (units, payload["reduce_scatter"] * FP32),
    }


def measured(rank: dict[str, Any]) -> dict[tuple[str, str], tuple[int, int]]:
    node = rank["node"]
    out = {}
    for c in rank["collectives"]:
        # Which nodes the group's ranks are on: two ranks per node, numbered node by node.
        where = "within node" if {r // 2 for r in c["ranks"]} == {node} else "across nodes"
        out[(where, c["kind"])] = (c["calls"], c["bytes"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/hsdp_two_nodes.md")
    args = parser.parse_args()
    hsdp, fsdp = two_nodes(2), two_nodes(4)
    predicted = hsdp_prediction(NODES, 2)
    expected = {"HSDP, mesh (2, 2)": predicted.collectives}
    expected["FSDP2 over both nodes, 1-D mesh"] = fsdp_prediction(4)
    lines = [
        "# HSDP across two nodes: bytes per collective, within and across nodes",
        "",
        "One invocation (`python benchmarks/hsdp_two_nodes.py`): two torchrun agents on one "
        "machine, two gloo ranks each, `examples/fsdp2_hsdp.py` (a 233k-parameter transformer, "
        "fp32, a unit per block). Rank 0's collectives of one training step, counted per "
        f"process group, against the prediction (HSDP: {predicted.source}):",
        "",
        "| layout | group | collective | calls | bytes measured | bytes predicted |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for (layout, pred), ranks in zip(expected.items(), (hsdp, fsdp), strict=True):
        got = measured(ranks[0])
        for key in sorted(set(got) | set(pred)):
            calls, nbytes = got.get(key, (0, 0))
            want = pred.get(key, (0, 0))
            lines.append(
                f"| {layout} | {key[0]} | {key[1]} | {calls} | {nbytes:,} | {want[1]:,}"
                f"{'' if (calls, nbytes) == want else ' (differs)'} |"
            )
    runs = zip(expected, (hsdp, fsdp), strict=True)
    state = {name: ranks[0]["model_state"]["total"] for name, ranks in runs}
    lines += [
        "",
        "Model state per rank: "
        + "; ".join(f"{name} {n:,} bytes" for name, n in state.items())
        + f" (HSDP keeps one copy per node, so twice FSDP's; predicted for HSDP: "
        f"{predicted.state.total:,} bytes).",
        "",
        "## On a real cluster",
        "",
        *cluster_projection(),
    ]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


def cluster_projection() -> list[str]:
    """Per rank and step, for 7B parameters on 2 nodes x 8 GPUs, bf16 gathers, fp32 reductions."""
    n = NODES * GPUS
    fsdp = predict_communication("fsdp2", PSI_7B, n, "bf16").payload
    hsdp = predict_communication("fsdp_hybrid", PSI_7B, n, "bf16").payload
    # fsdp_hybrid shards in pairs; the payloads scale to shard groups of one node's GPUs.
    hsdp_reduce = PSI_7B // GPUS
    assert hsdp["reduce_scatter"] == fsdp["reduce_scatter"] == PSI_7B
    rows = [
        ("FSDP2 over all 16 GPUs", "all-gather (bf16, forward and backward)",
         "across", 2 * fsdp["all_gather"], (n - 1) / n),
        ("FSDP2 over all 16 GPUs", "reduce-scatter (fp32 gradients)",
         "across", 4 * fsdp["reduce_scatter"], (n - 1) / n),
        ("HSDP, 8 GPUs per shard group", "all-gather (bf16)",
         "within", 2 * fsdp["all_gather"], (GPUS - 1) / GPUS),
        ("HSDP, 8 GPUs per shard group", "reduce-scatter (fp32)",
         "within", 4 * fsdp["reduce_scatter"], (GPUS - 1) / GPUS),
        ("HSDP, 8 GPUs per shard group", "all-reduce of the gradient shard (fp32)",
         "across", 4 * hsdp_reduce, 2 * (NODES - 1) / NODES),
    ]  # fmt: skip
    state = {
        name: plan(
            lambda: _Params(PSI_7B), batch_size=1, seq_len=1, world_size=w, strategy="fsdp2",
            precision="mixed", activations=0,
        ).state.total
        for name, w in (("FSDP2 over all 16 GPUs", n), ("HSDP, 8 GPUs per shard group", GPUS))
    }  # fmt: skip
    lines = [
        f"The same prediction for {PSI_7B / 1e9:.2f}B parameters on {NODES} nodes of {GPUS} "
        "GPUs, parameters gathered in bf16 and gradients reduced in fp32 "
        "(`MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`), "
        "per GPU and training step. Wire bytes are what a ring sends: (g-1)/g of the payload "
        "for an all-gather or reduce-scatter over g GPUs, 2(g-1)/g for an all-reduce.",
        "",
        "| layout | collective | group | payload | on the wire |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    for layout, kind, where, nbytes, wire in rows:
        group = "spans both nodes" if where == "across" else "inside one node"
        lines.append(
            f"| {layout} | {kind} | {group} | {format_bytes(nbytes)} "
            f"| {format_bytes(nbytes * wire)} |"
        )
    lines += [
        "",
        "Inside a node the GPUs talk over NVLink (hundreds of GB/s); between nodes over the "
        "network (tens of GB/s per GPU at best): the inter-node link is the slow one. Sharded "
        "over all 16 GPUs, every collective crosses it, including the all-gathers that the next "
        "layer waits for in forward and backward. With HSDP only the all-reduce of each "
        "gradient shard crosses it, once per unit in backward, where it overlaps with the "
        "gradients still being computed; its group has one GPU per node. The price is memory: "
        f"a GPU holds {format_bytes(state['HSDP, 8 GPUs per shard group'])} of model state "
        f"instead of {format_bytes(state['FSDP2 over all 16 GPUs'])} (bf16 compute, fp32 Adam).",
    ]
    return lines


class _Params:
    """A stand-in model of ``n`` parameters in one tensor, built on the meta device."""

    def __new__(cls, n: int) -> Any:
        import torch

        return torch.nn.Linear(1, n, bias=False, device="meta")  # n rows: FSDP2 cuts rows


if __name__ == "__main__":
    main()
