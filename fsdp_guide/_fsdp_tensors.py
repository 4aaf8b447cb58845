"""What a rank holds of a sharded model's tensors, written once for memory/ and wrap/ (private).

FairScale's FSDP and PyTorch FSDP1 keep a parameter's shard and its gathered copies in
private tensors hung on the (flat) parameter, and gradient shards beside them. Counting a
rank's bytes (:func:`fsdp_guide.memory.measure_model_state`) and telling parameters from
activations (:func:`fsdp_guide.wrap.saved_activation_bytes`) both need these names, and
both need FSDP2's DTensor parameters reduced to the shard this rank holds
(:func:`local_tensor`).
"""

from __future__ import annotations

import torch

# Tensors that hold a parameter's data: its shard, a low-precision copy of the shard, the
# padded gathered (unsharded) parameter. FairScale 0.4.13: ``_fp32_shard``, ``_fp16_shard``,
# ``_full_param_padded`` (``FullyShardedDataParallel._init_param_attributes``). PyTorch FSDP1,
# on the ``FlatParameter``: ``_local_shard``, ``_mp_shard``, ``_full_param_padded``,
# ``_full_prec_full_param_padded`` (``FlatParamHandle.init_flat_param_attributes``).
PARAM_BUFFERS: tuple[str, ...] = (
    "_local_shard",
    "_fp32_shard",
    "_fp16_shard",
    "_mp_shard",
    "_full_param_padded",
    "_full_prec_full_param_padded",
)

# Tensors that hold a gradient shard, in both libraries: ``_saved_grad_shard`` (accumulated
# across steps without ``no_sync``) and ``_cpu_grad`` (the pinned CPU copy when gradients or
# parameters are offloaded: FairScale even makes it ``p.grad``). Gradients, not parameters.
GRAD_BUFFERS: tuple[str, ...] = ("_saved_grad_shard", "_cpu_grad")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's (FSDP2) local shard, else ``tensor``.

    Args:
        tensor: A plain tensor, a parameter or a ``DTensor``.

    Returns:
        The local tensor, whose storage is what this rank allocated.

    Examples:
        >>> weight = torch.ones(2, 3)
        >>> local_tensor(weight) is weight
        True
    """
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            return tensor.to_local()
    return tensor
