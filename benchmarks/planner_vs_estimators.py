"""The planner next to DeepSpeed's ZeRO estimators and accelerate's memory estimate.

Same models for all three: Llama-3-8B on 8 GPUs (one node) and Llama-3-70B on 64 GPUs (8 nodes
of 8), built from transformers' ``LlamaConfig`` with the published sizes on the meta device
(``fsdp_guide.hf.hf_builder``: nothing downloaded, nothing allocated). DeepSpeed and accelerate
are not dependencies of the package; install them beside it to run this
(``pip install -c requirements/constraints.txt -e ".[dev]" accelerate``)::

    python benchmarks/planner_vs_estimators.py

It writes ``benchmarks/results/planner_vs_estimators.md``, whose table the "Will it fit?"
guide page includes.

- DeepSpeed: ``estimate_zero2_model_states_mem_needs`` and ``..._zero3_...`` (no offload) with
  the parameter count and the largest module's own parameters, counted here as DeepSpeed's
  ``model_to_params`` does (its ``_all_live`` variants tell tensors apart by ``data_ptr``,
  which is 0 for every tensor of a meta model, so they would see one tensor).
- accelerate: ``calculate_maximum_sizes`` on the model (what ``accelerate estimate-memory``
  computes after loading a model from the Hub, which is not reachable here) and the figure
  its "Training using Adam" column prints: the largest entry of ``estimate_training_usage``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_guide.engines import engine_for
from fsdp_guide.hf import hf_builder
from fsdp_guide.memory import Plan, build_on_meta, plan, traced_activation_bytes

RESULTS = Path(__file__).resolve().parent / "results" / "planner_vs_estimators.md"
PER_NODE, SEQ, GPU = 8, 8192, 80 * 10**9
_LLAMA3 = {"vocab_size": 128256, "max_position_embeddings": 8192, "num_key_value_heads": 8}
# The published sizes (config.json of Meta-Llama-3-8B and -70B); rope settings change no byte.
MODELS: dict[str, tuple[dict[str, int], int]] = {
    "8B": (
        {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, **_LLAMA3},
        8,
    ),
    "70B": (
        {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
         "num_attention_heads": 64, **_LLAMA3},
        64,
    ),
}  # fmt: skip
# (label, our strategy, precision, which DeepSpeed figure, which accelerate figure)
ROWS = (
    ("DDP fp32", "ddp", "fp32", None, "train_fp32"),
    ("DDP bf16", "ddp", "mixed", None, "train_bf16"),
    ("ZeRO-2 bf16", "deepspeed_zero2", "mixed", "zero2", None),
    ("ZeRO-3 bf16", "deepspeed_zero3", "mixed", "zero3", None),
    ("FSDP2 bf16", "fsdp2", "mixed", None, None),
)


def largest_layer_params(model: torch.nn.Module) -> int:
    """DeepSpeed's "largest layer": the most parameters any module holds directly."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def deepspeed_figures(num_params: int, largest: int, gpus: int) -> dict[str, int]:
    """Per-GPU bytes of ZeRO-2 and ZeRO-3 without offload, ``gpus`` in nodes of 8."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    nodes = {"num_gpus_per_node": PER_NODE, "num_nodes": gpus // PER_NODE, "cpu_offload": False}
    _, zero2 = estimate_zero2_model_states_mem_needs(num_params, **nodes)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(num_params, largest, **nodes)
    return {"zero2": zero2, "zero3": zero3}


def accelerate_figures(model: torch.nn.Module) -> dict[str, int]:
    """Model size and "Training using Adam" per dtype, as ``accelerate estimate-memory``."""
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    total, _ = calculate_maximum_sizes(model)  # fp32 bytes of parameters and buffers
    return {
        "size_fp32": int(total),
        "train_fp32": int(max(estimate_training_usage(total, "float32").values())),
        "train_bf16": int(max(estimate_training_usage(total, "bfloat16").values())),
    }


def gb(n: float | None) -> str:
    """GB with one decimal, two below 1 GB (a 26 MB bucket is 0.03, not 0.0)."""
    if n is None:
        return "–"
    return f"{n / 1e9:.1f}" if n >= 1e9 else f"{n / 1e9:.2f}"


def ours(model: torch.nn.Module, gpus: int, strategy: str, precision: Any, saved: int) -> Plan:
    block = type(model.model.layers[0])  # type: ignore[index, union-attr]
    return plan(model, batch_size=1, seq_len=SEQ, world_size=gpus, strategy=strategy,
                precision=precision, activation_checkpointing=block, activations=saved)  # fmt: skip


def main() -> None:
    import deepspeed
    import transformers

    out = [
        "# The planner next to DeepSpeed's and accelerate's estimates",
        "",
        f"Llama-3-8B on 8 GPUs and Llama-3-70B on 64 GPUs ({PER_NODE} per node), built from "
        "transformers' `LlamaConfig` on the meta device; Adam; GB = 10^9 bytes per GPU. Ours: "
        "`fsdp_guide.memory.plan` on the fullest rank: model *state* (parameters, gradients, "
        f"optimizer state), activations (*act.*) at batch 1 and {SEQ:,} tokens with every decoder "
        "layer checkpointed, the *transient* buffer, and their *total*; *fits* is that total "
        "against 80 GB less a 10% margin. ZeRO-2 and ZeRO-3 are DeepSpeed's "
        "(`deepspeed_zero2`, `deepspeed_zero3`). Generated by "
        f"`python benchmarks/planner_vs_estimators.py` (torch {torch.__version__}, "
        f"transformers {transformers.__version__}, deepspeed {deepspeed.__version__}, "
        f"accelerate {_version('accelerate')}).",
        "",
        "<!-- table -->",
        "",
        "| model | setting | state | act. | transient | total | fits | DeepSpeed | accelerate |",
        "| --- | --- | ---: | ---: | ---: | ---: | :---: | ---: | ---: |",
    ]
    notes = []
    for name, (fields, gpus) in MODELS.items():
        model = build_on_meta(hf_builder("llama", fields))
        n = sum(p.numel() for p in model.parameters())
        largest = largest_layer_params(model)
        ds = deepspeed_figures(n, largest, gpus)
        acc = accelerate_figures(model)
        notes.append(
            f"Llama-3-{name}: {n:,} parameters, largest module {largest:,} (the embedding and the "
            f"head), {gpus} GPUs; accelerate's model size {gb(acc['size_fp32'])} GB in fp32"
        )
        block = type(model.model.layers[0])  # type: ignore[index, union-attr]
        # One trace per way of running (fp32; bf16 by autocast or by cast parameters), as
        # plan() would trace for each strategy.
        saved = {
            (precision, mixed): traced_activation_bytes(
                model, 1, SEQ, precision=precision, activation_checkpointing=block, mixed=mixed
            )
            for precision, mixed in (
                ("fp32", "autocast"),
                ("mixed", "autocast"),
                ("mixed", "params"),
            )
        }
        for label, strategy, precision, ds_key, acc_key in ROWS:
            cast = precision == "mixed" and engine_for(strategy).mixed_precision == "params"
            p = ours(
                model, gpus, strategy, precision, saved[precision, "params" if cast else "autocast"]
            )
            state = p.device_state
            out.append(
                f"| {name} | {label} | {gb(state)} | {gb(p.activations)} | {gb(p.transient)} "
                f"| {gb(p.total)} | {'yes' if p.fits(GPU) else 'no'} "
                f"| {gb(ds[ds_key]) if ds_key else '–'} | {gb(acc[acc_key]) if acc_key else '–'} |"
            )
    out += ["", "<!-- end table -->", "", *(f"- {note}" for note in notes)]
    RESULTS.write_text("\n".join(out).rstrip() + "\n", encoding="utf-8")
    print("\n".join(out))
    print(f"wrote {RESULTS}")


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
