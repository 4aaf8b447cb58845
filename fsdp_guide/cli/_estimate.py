"""``python -m fsdp_guide estimate``: the ZeRO table of model-state bytes per GPU, every stage."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from fsdp_guide.cli._args import (
    MAX_TOKENS,
    MAX_WORLD_SIZE,
    catalog_names,
    count,
    fraction,
    import_path,
    input_spec,
    int_at_least,
    key_value,
    positive_size,
    schedule_name,
    seconds,
    wrap_policy,
)
from fsdp_guide.cli._estimate_practice import add_options, check
from fsdp_guide.memory import OptimizerName, Precision


def _strategy_lines() -> str:
    """Every strategy of the catalog with its aliases and summary, for ``--help``."""
    from fsdp_guide.catalog import STRATEGIES

    lines = []
    for spec in STRATEGIES.values():
        also = f" (also {', '.join(spec.aliases)})" if spec.aliases else ""
        lines.append(f"  {spec.name}{also}: {spec.summary}")
    return "\n".join(lines)


# One line each: the site renders this text as reStructuredText, where an indented
# continuation line starts a block quote.
_COLUMNS = (
    (
        "params, grads, optimizer, master, buckets",
        "model state on the GPU (master: DeepSpeed's fp32 copy; buckets: communication "
        "buffers kept between steps)",
    ),
    ("activations", "what autograd saves in forward"),
    ("transient", "the largest short-lived buffer (a gathered unit, DDP's bucket)"),
    ("total", "the sum of the columns before it"),
    (
        "peak",
        "the most held at once in a step (forward, backward or the optimizer step), what "
        "must fit --gpu-memory",
    ),
    ("host", "model state kept in host memory (offload)"),
    (
        "payload",
        "per optimizer step, the tensor each collective reduces, gathers or broadcasts, in "
        "its precision (gradients in --reduce-dtype)",
    ),
    (
        "wire",
        "per optimizer step, what the rank sends in a ring: 2(g-1)/g of an all-reduce's "
        "payload, (g-1)/g of the others', over a group of g ranks",
    ),
)


def _column_lines() -> str:
    return "\n".join(f"  {name}: {meaning}" for name, meaning in _COLUMNS)


_EPILOG = f"""strategies:
{_strategy_lines()}

columns (bytes per GPU, on the rank that holds the most):
{_column_lines()}
"""


def add_parser(sub: Any) -> None:
    """Register the ``estimate`` command."""
    p: argparse.ArgumentParser = sub.add_parser(
        "estimate",
        help="will it fit: memory per GPU and communication of a training step, per strategy",
        description="With --params: the model state per GPU (parameters, gradients, optimizer "
        "state) that the ZeRO formulas give for stages 0-3, nothing else. With --model or "
        "--hf: a real model planned for every strategy without allocating it: each rank's "
        "state as its engine lays it out (on the GPU and, where offloaded, in host memory), "
        "the activations traced over the whole step, the step's peak on the GPU (what must "
        "fit --gpu-memory), and the communication per optimizer step in payload and wire "
        "bytes.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=count, help="parameter count, e.g. 7e9, 7B, 350M")
    what.add_argument(
        "--model",
        type=import_path,
        help="plan a real model, built by package.module:builder on the meta device "
        "(activations traced, nothing allocated), e.g. fsdp_guide.models:TinyTransformer; "
        "the builder may return a transformers model",
    )
    what.add_argument(
        "--hf",
        metavar="TYPE",
        help="plan a transformers model built from its config class, offline: a model type "
        "(llama, gpt2, bert, t5, vit, ...) with its usual head, or a class name such as "
        "LlamaForSequenceClassification; set config fields with --hf-arg",
    )
    p.add_argument(
        "--hf-arg",
        type=key_value,
        action="append",
        metavar="FIELD=VALUE",
        help="config field of --hf (repeat it), e.g. hidden_size=8192",
    )
    p.add_argument(
        "--input",
        type=input_spec,
        action="append",
        metavar="NAME:DTYPE[DIMS]",
        help="state an input of the model's forward (repeat it; replaces the batch read from "
        "the model), e.g. input_ids:int64[B,S]; B is --batch-size, S --seq-len; a labels "
        "input makes the model compute its own loss",
    )
    p.add_argument(
        "--build-timeout",
        type=seconds,
        default=120.0,
        metavar="SECONDS",
        help="time allowed to import, build and trace the --model or --hf model; default 120",
    )
    p.add_argument(
        "--model-arg",
        type=key_value,
        action="append",
        metavar="KEY=VALUE",
        help="keyword argument of the builder (repeat it)",
    )
    p.add_argument(
        "--batch-size", type=int_at_least(1, MAX_TOKENS), default=1, help="samples per rank"
    )
    p.add_argument(
        "--seq-len",
        type=int_at_least(1, MAX_TOKENS),
        default=None,
        help="tokens per sample; default: the longest the model takes (512 without a limit)",
    )
    p.add_argument(
        "--strategy",
        type=catalog_names,
        default=None,
        metavar="NAMES",
        help="comma-separated strategies to plan (names listed below); default all",
    )
    p.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="blocks",
        default=None,
        metavar="LAYER",
        help="checkpoint each block (the repeated layer of the model), or each module of "
        "package.module:Class",
    )
    p.add_argument(
        "--wrap",
        type=wrap_policy,
        default=None,
        metavar="POLICY",
        help="with --model or --hf: how the fully sharded strategies (fsdp, fsdp2, "
        "fairscale_fsdp and their variants; deepspeed_zero3's gathered parameters follow it "
        "too) cut the model into units gathered one at a time: blocks, a unit per transformer "
        "block (default); root, the whole model one unit; min_params=N, a unit per module of "
        "at least N parameters not in a smaller unit (N such as 1e6 or 1M); "
        "package.module:Class, a unit per module of that class (several comma-separated), "
        "e.g. fsdp_guide.models:Block. The other "
        "strategies have no units",
    )
    p.add_argument(
        "--margin", type=fraction, default=0.1, help="share of GPU memory kept free; default 0.1"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per strategy and rank; the batch used is said on stderr",
    )
    p.add_argument(
        "--world-size",
        type=int_at_least(1, MAX_WORLD_SIZE),
        default=8,
        help="number of GPUs (ranks); default 8",
    )
    p.add_argument(
        "--tensor-parallel",
        type=int_at_least(1),
        default=1,
        metavar="T",
        help="with --model: ranks per tensor-parallel group, FSDP2 on the other mesh dimension "
        "(the model's tp_plan says which layers are cut); default 1",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tensor-parallel: cut the norms and the residual stream along the sequence "
        "over the tensor-parallel ranks too",
    )
    p.add_argument(
        "--pipeline-parallel",
        type=int_at_least(1),
        default=1,
        metavar="P",
        help="with --model: pipeline ranks; the model (an nn.Sequential, or one with "
        "pipeline_layers()) is cut into stages of whole layers on a (P, data, tensor) mesh; "
        "--batch-size is then each pipeline's batch; planned in fp32 (--precision fp32) with "
        "fsdp2 on the data-parallel ranks; default 1",
    )
    p.add_argument(
        "--microbatches",
        type=int_at_least(1),
        default=None,
        metavar="M",
        help="with --pipeline-parallel: micro-batches per step, dividing --batch-size; default P",
    )
    p.add_argument(
        "--schedule",
        type=schedule_name,
        default=None,
        metavar="NAME",
        help="with --pipeline-parallel: GPipe, 1F1B (default), Interleaved1F1B, "
        "InterleavedZeroBubble or ZBVZeroBubble, torch.distributed.pipelining's schedules",
    )
    p.add_argument(
        "--stages-per-rank",
        type=int_at_least(1),
        default=None,
        metavar="V",
        help="with --pipeline-parallel: stages each pipeline rank holds; 1 for GPipe and "
        "1F1B, default 2 for the others",
    )
    p.add_argument(
        "--context-parallel",
        type=int_at_least(1),
        default=1,
        metavar="C",
        help="with --model or --hf: ranks per context-parallel group; each computes 1/C of "
        "every sequence and its attention passes K/V blocks round a ring (ring attention); "
        "--batch-size is then per group; default 1",
    )
    p.add_argument(
        "--cp-layout",
        choices=("zigzag", "naive"),
        default="zigzag",
        help="with --context-parallel: cut each sequence into 2C chunks, rank r taking chunks "
        "r and 2C-1-r (zigzag, balanced causal work; the sequence must divide by 2C), or into "
        "C consecutive chunks (naive); default zigzag",
    )
    p.add_argument(
        "--expert-parallel",
        type=int_at_least(1),
        default=1,
        metavar="E",
        help="with --model or --hf and a mixture of experts: ranks per expert-parallel group; "
        "each keeps 1/E of every layer's experts (sharded by fsdp2 over the ranks holding the "
        "same ones) and all-to-alls route the tokens, planned for a balanced router; needs "
        "--activations; default 1",
    )
    p.add_argument(
        "--activations",
        type=positive_size,
        default=None,
        metavar="SIZE",
        help="with --model or --hf: the bytes autograd saves per rank in one forward, measured "
        "on a real one (fsdp_guide.wrap.saved_activation_bytes), e.g. 1.2GB, in place of the "
        "trace; for models a trace cannot follow, such as a mixture of experts",
    )
    p.add_argument(
        "--precision",
        choices=get_args(Precision),
        default="mixed",
        help="mixed: bf16 compute with fp32 master weights (default); fp32",
    )
    p.add_argument(
        "--optimizer",
        choices=get_args(OptimizerName),
        default="adam",
        help="adam (default) or adamw: the same memory (AdamW's decoupled weight decay keeps "
        "no state of its own); sgd; sgd_momentum",
    )
    p.add_argument(
        "--gpu-memory",
        type=positive_size,
        default=None,
        help="memory per GPU with its unit: 80GB (10^9 bytes) or 80GiB (2^30 bytes); a "
        "strategy fits when its step's peak on the GPU does, less --margin",
    )
    p.add_argument(
        "--host-memory",
        type=positive_size,
        default=None,
        metavar="SIZE",
        help="host memory per GPU (its share of the node's RAM), e.g. 200GB: what offload "
        "keeps there must fit it too",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int_at_least(1, MAX_WORLD_SIZE),
        default=8,
        metavar="G",
        help="GPUs of a node; default 8. HSDP (fsdp2_hybrid, fsdp_hybrid) shards within a "
        "node and replicates across nodes; the inter-node wire bytes are those of the "
        "collectives whose group spans nodes",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=("fp32", "bf16"),
        default=None,
        help="with --precision mixed: what the gradients are reduced in; default fp32 for "
        "every strategy, as examples/fsdp2_train.py sets reduce_dtype (DeepSpeed's own "
        "default, communication_data_type, is bf16)",
    )
    p.add_argument(
        "--grad-accum",
        type=int_at_least(1, MAX_TOKENS),
        default=1,
        metavar="K",
        help="with --model or --hf: micro-batches of --batch-size per optimizer step; "
        "default 1. The gradients of the first are held through the others; FSDP and "
        "DeepSpeed ZeRO-2/3 reduce every micro-batch (payload and wire are per optimizer "
        "step), DDP and ZeRO-1 once (--sync-each-micro-step changes it for ddp, fsdp, fsdp2)",
    )
    p.add_argument(
        "--max-batch",
        action="store_true",
        help="with --gpu-memory: also find, per strategy, the largest --batch-size whose step "
        "fits (a column 'max batch')",
    )
    add_options(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from fsdp_guide.errors import CommandError

    if args.model is None and args.hf is None and args.tensor_parallel > 1:
        raise CommandError(
            "--tensor-parallel needs a real model (--model package.module:builder): the layers "
            "it cuts come from the model's tp_plan"
        )
    if args.model is None and args.hf is None and args.wrap is not None:
        raise CommandError(
            "--wrap needs a real model (--model package.module:builder or --hf TYPE): its units "
            "are the model's modules, which --params does not have"
        )
    if args.max_batch and args.gpu_memory is None:
        raise CommandError("--max-batch finds the largest batch that fits: give --gpu-memory")
    if args.model is None and args.hf is None and args.max_batch:
        raise CommandError(
            "--max-batch plans a real model's activations (--model package.module:builder or "
            "--hf TYPE); --params plans the model state only"
        )
    if args.model is None and args.hf is None and args.activations is not None:
        raise CommandError(
            "--activations replaces a real model's traced activations (--model "
            "package.module:builder or --hf TYPE); --params plans the model state only"
        )
    pipeline = [args.microbatches, args.schedule, args.stages_per_rank]
    if args.pipeline_parallel == 1 and any(v is not None for v in pipeline):
        raise CommandError(
            "--microbatches, --schedule and --stages-per-rank shape a pipeline: pass "
            "--pipeline-parallel P (P > 1) as well"
        )
    if args.pipeline_parallel > 1 and args.model is None:
        raise CommandError(
            "--pipeline-parallel needs a real model (--model package.module:builder): its "
            "stages are the model's layers"
        )
    if args.pipeline_parallel > 1 and args.precision != "fp32":
        raise CommandError("--pipeline-parallel is planned in fp32: add --precision fp32")
    if args.model is None and args.hf is None:
        for flag, value in (("--context-parallel", args.context_parallel),
                            ("--expert-parallel", args.expert_parallel)):  # fmt: skip
            if value > 1:
                raise CommandError(
                    f"{flag} needs a real model (--model package.module:builder or --hf TYPE): "
                    "what it cuts is the model's sequence or experts, which --params does not have"
                )
    if args.sequence_parallel and args.tensor_parallel == 1:
        raise CommandError(
            "--sequence-parallel cuts the sequence over the tensor-parallel ranks: pass "
            "--tensor-parallel T (T > 1) with --model as well"
        )
    check(args)
    if args.model is not None or args.hf is not None:
        from fsdp_guide.cli._estimate_model import run_model

        return run_model(args)
    from fsdp_guide.cli._estimate_table import estimate_table

    table = estimate_table(
        args.params, args.world_size, args.precision, args.optimizer, args.gpu_memory
    )
    print(table)
    print(
        "Model state only: activations, communication buffers and fragmentation come on top "
        "(plan a real model with --model or --hf)."
    )
    return 0
