"""``estimate --model``: plan a real model per strategy, and say which strategies fit (private)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any, Literal

from fsdp_guide.cli._args import WRAP_FORMS, WrapArg
from fsdp_guide.cli._estimate_practice import adapted, default_strategies, extra_lines, patterns
from fsdp_guide.cli._user_code import import_user_module, load_builder, time_limit
from fsdp_guide.errors import CommandError


def _checkpointing(value: str | None, model: Any) -> Any:
    """``None``, ``"blocks"`` (the model's repeated block), or ``package.module:Class``."""
    from torch import nn

    from fsdp_guide.models import Block

    if value is None:
        return None
    if value == "blocks":
        if any(isinstance(m, Block) for m in model.modules()):
            return "blocks"
        block = repeated_block(model)
        if block is None:
            raise CommandError(
                f"{type(model).__name__} has no repeated block to checkpoint; name its layer "
                "class: --activation-checkpointing package.module:Class"
            )
        return block
    module_name, colon, name = value.partition(":")
    layer = getattr(import_user_module(module_name), name, None) if colon else None
    if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
        raise CommandError(
            f"--activation-checkpointing takes 'blocks' or package.module:Class of a Module, "
            f"got {value!r}"
        )
    return layer


def wrap_rule(arg: WrapArg | None) -> Any:
    """The ``policy`` of :func:`fsdp_guide.memory.plan` that ``--wrap`` asks for (classes imported).

    Raises:
        CommandError: When a class cannot be imported or is not an ``nn.Module`` subclass.

    Examples:
        >>> from fsdp_guide.cli._args import wrap_policy
        >>> wrap_rule(None), wrap_rule(wrap_policy("root"))
        ('blocks', 'root')
        >>> wrap_rule(wrap_policy("min_params=2k")), wrap_rule(wrap_policy("torch.nn:Linear"))
        (SizePolicy(min_num_params=2000), LayerPolicy(Linear))
        >>> wrap_rule(wrap_policy("os:path"))
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CommandError: --wrap os:path: os.path is a module, not an nn.Module ...
    """
    from torch import nn

    from fsdp_guide.wrap import LayerPolicy, SizePolicy

    if arg is None:
        return "blocks"
    if arg.rule in ("blocks", "root"):
        return arg.rule
    if arg.rule == "min_params":
        return SizePolicy(min_num_params=arg.min_params)
    classes: list[type[nn.Module]] = []
    for path in arg.classes:
        module_name, _, name = path.partition(":")
        try:
            layer = getattr(import_user_module(module_name), name, None)
        except CommandError as exc:
            raise CommandError(f"--wrap {path}: {exc}; --wrap takes {WRAP_FORMS}") from exc
        if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
            found = (
                f"module {module_name} has no attribute {name!r}"
                if layer is None
                else f"{module_name}.{name} is a {type(layer).__name__}, not an nn.Module class"
            )
            raise CommandError(f"--wrap {path}: {found}; --wrap takes {WRAP_FORMS}")
        classes.append(layer)
    return LayerPolicy(*classes)


def _check_layers(policy: Any, model: Any, text: str) -> None:
    """A layer class that ``model`` does not hold would leave one unit: say so instead."""
    from fsdp_guide.engines import block_classes
    from fsdp_guide.wrap import LayerPolicy

    if not isinstance(policy, LayerPolicy):
        return
    missing = [
        c for c in policy.layer_classes if not any(isinstance(m, c) for m in model.modules())
    ]
    if missing:
        blocks = ", ".join(c.__name__ for c in block_classes(model)) or "none found"
        raise CommandError(
            f"--wrap {text}: no module of {type(model).__name__} is a "
            f"{', '.join(c.__name__ for c in missing)}; name a class it holds (its blocks: "
            f"{blocks}), or write --wrap blocks or --wrap root"
        )


def repeated_block(model: Any) -> type | None:
    """The class of the layers a ``ModuleList`` of ``model`` repeats, the most parameters first.

    The transformer block of a transformers model (``LlamaDecoderLayer``, ``T5Block``), or of
    any model that keeps its layers in a ``ModuleList``; ``None`` when there is none.

    Examples:
        >>> from fsdp_guide.models import TinyTransformer
        >>> repeated_block(TinyTransformer()).__name__
        'Block'
    """
    from torch import nn

    sizes: dict[type, int] = {}
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            for layer in module:
                if type(layer) is type(module[0]):
                    count = sum(p.numel() for p in layer.parameters())
                    sizes[type(layer)] = sizes.get(type(layer), 0) + count
    return max(sizes, key=lambda cls: sizes[cls]) if sizes else None


def _source(args: argparse.Namespace) -> tuple[Callable[[], Any], str]:
    """The model's builder and its name, from ``--model`` or ``--hf``."""
    if args.hf is None:
        if args.hf_arg:
            raise CommandError("--hf-arg sets a config field of --hf; use --model-arg with --model")
        return load_builder(args.model, dict(args.model_arg or [])), args.model
    if args.model_arg:
        raise CommandError("--model-arg is for --model's builder; use --hf-arg with --hf")
    from fsdp_guide.hf import hf_builder

    return hf_builder(args.hf, dict(args.hf_arg or [])), f"--hf {args.hf}"


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings about the config off while the model is built and traced."""
    import logging
    import os

    # transformers sets its logger's level from this variable when it is first imported
    # (inside the builder, say); the level is set too for when it was imported before.
    saved = os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    logger = logging.getLogger("transformers")  # the parent of every transformers logger
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
        if saved is None:
            del os.environ["TRANSFORMERS_VERBOSITY"]
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = saved


def _bf16_kind(strategy: str, precision: str) -> Literal["params", "autocast"]:
    """How ``strategy`` runs bf16 (what its activation trace follows); one kind in fp32."""
    from fsdp_guide.engines import engine_for

    mixed = precision == "mixed" and engine_for(strategy).mixed_precision == "params"
    return "params" if mixed else "autocast"


def _pipeline_options(args: argparse.Namespace) -> dict[str, Any]:
    """``plan()``'s pipeline keywords from the command line (none without a pipeline)."""
    pp = getattr(args, "pipeline_parallel", 1)
    if pp == 1:
        return {}
    return {
        "pipeline_parallel": pp,
        "microbatches": args.microbatches,
        "schedule": args.schedule,
        "stages_per_rank": args.stages_per_rank,
    }


def run_model(args: argparse.Namespace) -> int:
    """Plan ``args.model`` for each strategy; print a table (or JSON) and a recommendation."""
    from fsdp_guide.catalog import STRATEGIES
    from fsdp_guide.engines import engine_for, follows_units
    from fsdp_guide.errors import MissingRequirementError, PlanError
    from fsdp_guide.inputs import default_seq_len, example_batch
    from fsdp_guide.memory import Plan, build_on_meta, plan, traced_activation_bytes
    from fsdp_guide.models import MLP

    tp = getattr(args, "tensor_parallel", 1)
    pp = getattr(args, "pipeline_parallel", 1)
    cp, ep = getattr(args, "context_parallel", 1), getattr(args, "expert_parallel", 1)
    names = default_strategies(
        args, args.strategy or (["fsdp2"] if tp > 1 or pp > 1 or ep > 1 else list(STRATEGIES))
    )
    plans: list[Plan] = []
    with_units = [name for name in names if follows_units(engine_for(name))]
    if args.wrap is not None and not with_units:
        raise CommandError(
            f"--wrap changes only the strategies that cut the model into units (fsdp, fsdp2, "
            f"fairscale_fsdp and their variants, deepspeed_zero3); --strategy "
            f"{','.join(names)} has none of them"
        )
    what = f"importing, building and tracing {args.model or args.hf}"
    # Tracing imports some 800 modules on first use: done here, before the time limit, since
    # a limit that stopped an import half-way would leave this process with a broken module.
    traced_activation_bytes(build_on_meta(lambda: MLP(depth=1, hidden=2)), 1, 1)
    try:
        # The user's code (import, builder, forward) runs under the time limit.
        with time_limit(args.build_timeout, what), _quiet_transformers():
            builder, label = _source(args)
            builder = adapted(builder, args.trainable)
            policy = wrap_rule(args.wrap)  # its classes imported before the model is built
            model = build_on_meta(builder)
            _check_layers(policy, model, args.wrap.text if args.wrap else "")
            checkpointing = _checkpointing(args.activation_checkpointing, model)
            batch = example_batch(model, args.input or ())
            seq_len = args.seq_len or (default_seq_len(model) if batch.uses_seq_len else 1)
            # One trace serves every strategy that runs bf16 the same way (autocast, or cast
            # parameters; in fp32 all are alike); with tensor or context parallelism, plan()
            # traces the model as one rank cuts it.
            traces: dict[str, int] = {}
            measured = getattr(args, "activations", None)  # stated: no trace
            # Name patterns freeze parameters inside plan(), which then traces for itself.
            shared = tp == pp == cp == ep == 1 and measured is None
            for name in names if shared and patterns(args.trainable) is None else []:
                kind = _bf16_kind(name, args.precision)
                if kind not in traces:
                    traces[kind] = traced_activation_bytes(
                        model,
                        args.batch_size,
                        seq_len,
                        precision=args.precision,
                        activation_checkpointing=checkpointing,
                        batch=batch.build,
                        mixed=kind,
                    )
        for name in names:
            plans.append(
                plan(
                    model,
                    batch_size=args.batch_size,
                    seq_len=seq_len,
                    world_size=args.world_size,
                    strategy=name,
                    precision=args.precision,
                    activation_checkpointing=checkpointing,
                    optimizer=args.optimizer,
                    activations=measured or traces.get(_bf16_kind(name, args.precision)),
                    tensor_parallel=tp,
                    sequence_parallel=getattr(args, "sequence_parallel", False),
                    context_parallel=cp,
                    cp_layout=getattr(args, "cp_layout", "zigzag"),
                    expert_parallel=ep,
                    batch=batch.build,
                    **_pipeline_options(args),
                    policy=policy,
                    grad_accumulation=args.grad_accum,
                    sync_each_micro_step=args.sync_each_micro_step,
                    trainable=patterns(args.trainable),
                )
            )
    except (PlanError, MissingRequirementError) as exc:
        raise CommandError(str(exc)) from exc
    sizes = f"B={args.batch_size}" + (f", S={seq_len}" if batch.uses_seq_len else "")
    used = f"model: {type(model).__name__} ({label}); batch per rank ({sizes}): {batch.description}"
    if measured is not None:
        used += f"\nactivations: {measured:,} bytes per rank, as stated (--activations), not traced"
    if with_units:  # the same cut for each of them
        rule = args.wrap.text if args.wrap else "blocks"
        units = next(p.units for p in plans if p.units)
        used += f"\nunits: {units}, for {', '.join(with_units)} (--wrap {rule})"
    if args.json:
        rows = []
        for p in plans:
            for rank in range(p.world_size):  # ranks differ: whole-tensor and padded shards
                row: dict[str, Any] = p.as_dict(rank)
                if args.gpu_memory is not None:
                    row["fits"] = p.fits(args.gpu_memory, args.margin, rank=rank)
                rows.append(row)
        print(json.dumps(rows, indent=1))
        print(used, file=sys.stderr)  # stdout stays one JSON document
        return 0
    print(plan_table(plans, args.gpu_memory, args.margin))
    print("\n".join([*extra_lines(plans), used]))
    return 0


def plan_table(plans: list[Any], gpu_memory: int | None = None, margin: float = 0.1) -> str:
    """One line per strategy, its fullest rank, and the recommendation when a GPU size is given.

    The recommendation (``recommend``) is the strategy that fits
    (within ``gpu_memory`` less the margin) on the best-maintained engine (FSDP2 before FSDP1,
    both before FairScale), with the least communication per step, then the least memory;
    under it, the fine-tuning recipe of the repository's ``examples/recipes`` that trains
    that way.

    Examples:
        >>> from fsdp_guide.memory import plan
        >>> from fsdp_guide.models import MLP
        >>> plans = [plan(MLP(), batch_size=8, seq_len=1, world_size=2, strategy=s)
        ...          for s in ("ddp", "fsdp", "fsdp2")]
        >>> print(plan_table(plans, gpu_memory=2_600_000))
        142,088 parameters on 2 ranks, fp32 precision; bytes on the fullest rank
        strategy  params   grads    optimizer  activations  transient  total    comm/step  fits
        ddp       0.57 MB  0.57 MB  1.14 MB    26.11 KB     0.57 MB    2.87 MB  0.57 MB    no
        fsdp      0.28 MB  0.28 MB  0.57 MB    26.11 KB     1.14 MB    2.30 MB  1.14 MB    yes
        fsdp2     0.28 MB  0.28 MB  0.57 MB    26.11 KB     1.14 MB    2.30 MB  1.14 MB    yes
        recommended: fsdp2 (fits 2.60 MB with 10% margin; maintained engines first,
        then the least communication)
        recipe: examples/recipes/fsdp2_finetune.py
    """
    from fsdp_guide.cli._estimate import readable
    from fsdp_guide.cli._recipe import recipe_for
    from fsdp_guide.compare import text_table
    from fsdp_guide.memory import format_bytes, recommend

    largest = max(p.total for p in plans)
    unit = "GB" if largest >= 1e8 else "MB" if largest >= 1e5 else "KB"
    header = ["strategy", "params", "grads", "optimizer", "activations", "transient", "total"]
    header.append("comm/step")
    if gpu_memory is not None:
        header.append("fits")
    rows = [header]
    for p in plans:
        state = (0, 0, 0) if p.cpu_offload else (p.state.params, p.state.grads, p.state.optimizer)
        values = (*state, p.activations, p.transient, p.total, p.communication.payload_bytes)
        cells = [p.strategy, *(readable(v, unit) for v in values)]
        if gpu_memory is not None:
            cells.append("yes" if p.fits(gpu_memory, margin) else "no")
        rows.append(cells)
    first = plans[0]
    title = (
        f"{first.num_params:,} parameters on {first.world_size} ranks, {first.precision} "
        "precision; bytes on the fullest rank"
    )
    out = [title, text_table(rows)]
    if gpu_memory is not None:
        best = recommend(plans, gpu_memory, margin)
        size = format_bytes(gpu_memory).replace(".00", "")
        if best is not None:
            out.append(
                f"recommended: {best.strategy} (fits {size} with {margin:.0%} margin; "
                "maintained engines first, then the least communication)"
            )
            out.append(f"recipe: {recipe_for(best.strategy)}")
        else:
            out.append(f"recommended: none fits {size} with {margin:.0%} margin; add GPUs")
    return "\n".join(out)
