"""shard(engine="fairscale") swaps PyTorch's checkpoint wrappers for FairScale's, on CPU.

FairScale's FSDP (CUDA only) fails in backward when PyTorch's ``CheckpointWrapper`` sits
around one of its units; :func:`fairscale_checkpointing` is what its ``shard`` applies first.
Here, without FSDP: the swapped model must compute, save and name exactly what PyTorch's
checkpointed model does.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from fsdp_guide.engines.fairscale_fsdp import fairscale_checkpointing
from fsdp_guide.models import Block, TinyTransformer, TransformerConfig, loss_fn, synthetic_batch
from fsdp_guide.wrap import checkpoint_layers, is_checkpointed, saved_activation_bytes

CONFIG = TransformerConfig(vocab_size=64, dim=32, n_heads=2, n_layers=2, seq_len=16)


def checkpointed() -> nn.Module:
    torch.manual_seed(0)
    return checkpoint_layers(TinyTransformer(CONFIG), Block)


def step(model: nn.Module) -> tuple[int, float, dict[str, torch.Tensor]]:
    batch = synthetic_batch("transformer", 4, config=CONFIG)
    nbytes, loss = saved_activation_bytes(model, lambda: loss_fn(model, batch))
    loss.backward()  # type: ignore[no-untyped-call]
    # Named as in the state dict: PyTorch's wrapper adds its attribute to parameter names.
    grads = {
        name.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return nbytes, loss.item(), grads


def test_swapped_model_matches_pytorch_checkpointing() -> None:
    torch_model = checkpointed()
    swapped = fairscale_checkpointing(checkpointed())
    assert not any(isinstance(m, CheckpointWrapper) for m in swapped.modules())
    blocks = list(swapped.blocks)  # type: ignore[arg-type]
    assert all(type(b) is Block and is_checkpointed(b) for b in blocks)
    assert swapped.state_dict().keys() == torch_model.state_dict().keys()
    nbytes, loss, grads = step(swapped)
    expected_bytes, expected_loss, expected_grads = step(torch_model)
    assert (nbytes, loss) == (expected_bytes, expected_loss)
    assert grads.keys() == expected_grads.keys() == swapped.state_dict().keys()
    assert all(torch.equal(grads[k], expected_grads[k]) for k in grads)


def test_a_wrapper_given_alone_becomes_its_layer() -> None:
    wrapper = checkpointed().blocks[0]
    assert isinstance(wrapper, CheckpointWrapper)
    layer = fairscale_checkpointing(wrapper)
    assert type(layer) is Block and is_checkpointed(layer)


def test_a_model_without_wrappers_is_left_alone() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    assert fairscale_checkpointing(model) is model
    assert not any(is_checkpointed(m) for m in model.modules())
