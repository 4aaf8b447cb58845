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
    from fsdp_guide.cli._estimate_table import largest_batch, plan_table
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
            measured = getattr(args, "activations", None)  # stated: no trace

            def planned(name: str, batch_size: int = args.batch_size) -> Plan:
                return plan(
                    model,
                    batch_size=batch_size,
                    seq_len=seq_len,
                    world_size=args.world_size,
                    strategy=name,
                    precision=args.precision,
                    activation_checkpointing=checkpointing,
                    optimizer=args.optimizer,
                    activations=measured,
                    tensor_parallel=tp,
                    sequence_parallel=getattr(args, "sequence_parallel", False),
                    context_parallel=cp,
                    cp_layout=getattr(args, "cp_layout", "zigzag"),
                    expert_parallel=ep,
                    batch=batch.build,
                    **_pipeline_options(args),
                    policy=policy,
                    gpus_per_node=getattr(args, "gpus_per_node", None),
                    reduce_dtype=getattr(args, "reduce_dtype", None),
                    grad_accumulation=getattr(args, "grad_accum", 1),
                    sync_each_micro_step=getattr(args, "sync_each_micro_step", None),
                    trainable=patterns(getattr(args, "trainable", None)),
                )

            # The model's forward and backward run once per way of running bf16 (autocast,
            # or cast parameters; in fp32 all are alike), under the time limit; the other
            # strategies reuse that trace.
            by_name: dict[str, Plan] = {}
            kinds: set[str] = set()
            for name in names:
                if _bf16_kind(name, args.precision) not in kinds:
                    kinds.add(_bf16_kind(name, args.precision))
                    by_name[name] = planned(name)
        plans = [by_name[name] if name in by_name else planned(name) for name in names]
        host = getattr(args, "host_memory", None)
        largest: dict[str, int] = {}
        if getattr(args, "max_batch", False):
            for p in plans:
                largest[p.strategy] = largest_batch(
                    lambda b, n=p.strategy: planned(n, b),  # type: ignore[misc]
                    args.gpu_memory,
                    args.margin,
                    host,
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
    if getattr(args, "optimizer", "adam") == "adamw":
        used += "\noptimizer: adamw, planned as adam (the same moments; weight decay adds none)"
    if args.json:
        rows = []
        for p in plans:
            for rank in range(p.world_size):  # ranks differ: whole-tensor and padded shards
                row: dict[str, Any] = p.as_dict(rank)
                if args.gpu_memory is not None:
                    row["fits"] = p.fits(args.gpu_memory, args.margin, rank=rank, host_memory=host)
                if p.strategy in largest:
                    row["max_batch"] = largest[p.strategy]
                rows.append(row)
        print(json.dumps(rows, indent=1))
        print(used, file=sys.stderr)  # stdout stays one JSON document
        return 0
    print(plan_table(plans, args.gpu_memory, args.margin, host, largest))
    print("\n".join([*extra_lines(plans), used]))
    return 0
