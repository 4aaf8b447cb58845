"""Which fine-tuning recipe of ``examples/recipes`` trains with a strategy (private).

``estimate`` names it under its recommendation. There is one recipe per engine that the
recommendation prefers: DDP, FSDP2 (HSDP too) and DeepSpeed (ZeRO-1 to 3, with offload). A
strategy of another engine gets the recipe that shards the same way, and says so.
"""

from __future__ import annotations

from fsdp_guide.catalog import get_strategy

#: Where the recipes are, from the root of the repository.
RECIPES_DIR = "examples/recipes"
#: The settings of catalog rows that :func:`recipe_for` turns into options.
HANDLED_SETTINGS = frozenset(
    {
        "sharding_strategy",
        "shard_group",
        "reshard_after_forward",
        "offload_policy",
        "offload",
        "cpu_offload",
        "stage",
        "offload_optimizer",
        "offload_params",
        "reduce_buffer_size",
    }
)
_RECIPE_ENGINES = ("ddp", "fsdp2", "deepspeed")


def recipe_for(strategy: str) -> str:
    """The recipe, with its options, that trains as ``strategy`` does.

    Args:
        strategy: A strategy name or alias of :data:`fsdp_guide.catalog.STRATEGIES`.

    Returns:
        ``examples/recipes/<script> [options]``, and a note when the recipe runs another
        engine than the strategy's.

    Examples:
        >>> recipe_for("fsdp2")
        'examples/recipes/fsdp2_finetune.py'
        >>> recipe_for("fsdp2_hybrid")
        'examples/recipes/fsdp2_finetune.py --gpus-per-node <GPUs a node>'
        >>> recipe_for("deepspeed_zero3_offload")
        'examples/recipes/deepspeed_zero3_finetune.py --offload-optimizer --offload-params'
        >>> recipe_for("zero1")
        'examples/recipes/deepspeed_zero3_finetune.py --zero-stage 1 (the same sharding on ...)'
    """
    spec = get_strategy(strategy)
    settings = spec.settings
    flags: list[str] = []
    if spec.engine == "ddp" or settings.get("sharding_strategy") == "NO_SHARD":
        script, engine = "ddp_finetune.py", "ddp"
    elif spec.engine in ("fsdp2", "fsdp1", "fairscale_fsdp"):
        script, engine = "fsdp2_finetune.py", "fsdp2"
        if "shard_group" in settings or settings.get("sharding_strategy") == "HYBRID_SHARD":
            flags.append("--gpus-per-node <GPUs a node>")
        grad_op = settings.get("sharding_strategy") == "SHARD_GRAD_OP"
        if grad_op or settings.get("reshard_after_forward") is False:
            flags.append("--no-reshard-after-forward")
        if settings.get("offload_policy") or settings.get("offload") or settings.get("cpu_offload"):
            flags.append("--cpu-offload")
    else:  # DeepSpeed, and the other optimizer- and gradient-sharding engines
        script, engine = "deepspeed_zero3_finetune.py", "deepspeed"
        if spec.zero_stage != 3:
            flags.append(f"--zero-stage {max(spec.zero_stage, 1)}")
        if settings.get("offload_optimizer"):
            flags.append("--offload-optimizer")
        if settings.get("offload_params"):
            flags.append("--offload-params")
    command = " ".join([f"{RECIPES_DIR}/{script}", *flags])
    if spec.engine != engine:
        names = {"ddp": "DDP", "fsdp2": "FSDP2", "deepspeed": "DeepSpeed"}
        command += f" (the same sharding on {names[engine]})"
    return command
