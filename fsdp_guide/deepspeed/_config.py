"""The DeepSpeed configuration the guide trains with: :func:`zero_config` (private).

Plain data, no DeepSpeed import: the preflight check reads the same dictionary before any
process starts.
"""

from __future__ import annotations

from typing import Any

#: Elements per reduce and all-gather bucket. DeepSpeed's default (5e8) allocates a 2 GB
#: bucket per rank, which hides the sharding of a small model behind untouched pages.
BUCKET_ELEMENTS = 2**16


def zero_config(
    stage: int,
    *,
    lr: float = 1e-3,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    bucket_elements: int = BUCKET_ELEMENTS,
    bf16: bool = False,
) -> dict[str, Any]:
    """A DeepSpeed config for ZeRO ``stage`` with plain Adam, as the guide trains it.

    Adam is torch's own (``"torch_adam": True``): no DeepSpeed op is compiled, on CPU as on
    GPU, and offloading keeps it (``"zero_force_ds_cpu_optimizer": False``) instead of
    insisting on ``DeepSpeedCPUAdam`` and its compiled ``cpu_adam`` op.

    ``"adam_w_mode": False`` is not optional: DeepSpeed's optimizer type ``"Adam"`` builds
    ``torch.optim.AdamW`` (decoupled weight decay, 0.01 by default) unless told otherwise,
    so a config that only says ``{"type": "Adam"}`` silently trains another optimizer and
    its losses drift from ``torch.optim.Adam``'s from the first step.

    One micro-batch per rank and step, no gradient accumulation: each
    ``engine.step()`` is one optimizer step, as ``optimizer.step()`` is elsewhere. The
    batch size DeepSpeed records is bookkeeping only here, since the caller feeds the engine.

    Args:
        stage: ZeRO stage, 0 to 3.
        lr: Adam's learning rate.
        offload_optimizer: Keep the optimizer state (and the fp32 master copy) on the CPU
            and step there (stages 1 to 3).
        offload_params: Keep the parameter shards on the CPU between uses (stage 3 only).
        bucket_elements: Elements per reduce and all-gather bucket.
        bf16: Train in bf16 (``"bf16": {"enabled": True}``): DeepSpeed casts the model to
            bf16, reduces bf16 gradients and steps an fp32 master copy of each rank's
            partition. Off: everything stays fp32.

    Returns:
        A dictionary for ``deepspeed.initialize(config=...)``.

    Raises:
        ValueError: A stage outside 0 to 3, optimizer offload below stage 1, parameter
            offload below stage 3, or a bucket below one element.

    Examples:
        >>> config = zero_config(3, offload_params=True, offload_optimizer=True)
        >>> config["optimizer"]["params"]
        {'lr': 0.001, 'torch_adam': True, 'adam_w_mode': False}
        >>> zero = config["zero_optimization"]
        >>> zero["stage"], zero["offload_param"]["device"], zero["offload_optimizer"]["device"]
        (3, 'cpu', 'cpu')
        >>> zero_config(1, offload_params=True)
        Traceback (most recent call last):
        ...
        ValueError: parameter offload needs ZeRO stage 3, got stage 1
        >>> zero_config(2, bf16=True)["bf16"]
        {'enabled': True}
    """
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload_optimizer and stage < 1:
        raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3, got stage 0")
    if offload_params and stage < 3:
        raise ValueError(f"parameter offload needs ZeRO stage 3, got stage {stage}")
    if bucket_elements < 1:
        raise ValueError(f"bucket_elements must be >= 1, got {bucket_elements}")
    if not isinstance(bf16, bool):
        raise ValueError(f"bf16 must be True or False, got {bf16!r}")
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero["reduce_bucket_size"] = bucket_elements
        zero["allgather_bucket_size"] = bucket_elements
    if stage == 3:
        # The default threshold (1e5 elements) keeps every tensor of a small model whole on
        # every rank; 0 shards them all, as FSDP does.
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_prefetch_bucket_size"] = bucket_elements
    # No pinned memory: pinning needs CUDA, and on CPU there is nothing to pin for.
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": lr, "torch_adam": True, "adam_w_mode": False},
        },
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # DeepSpeed's progress lines would drown the lesson's
        "wall_clock_breakdown": False,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config
