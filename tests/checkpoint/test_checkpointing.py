"""Activation checkpointing: saved activation memory, equal gradients, BatchNorm statistics."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from fsdp_guide.models import Block, TinyTransformer, TransformerConfig, loss_fn, synthetic_batch
from fsdp_guide.wrap import (
    checkpoint_layers,
    checkpointed_names,
    describe,
    is_checkpointed,
    saved_activation_bytes,
)

CONFIG = TransformerConfig(vocab_size=64, dim=32, n_heads=2, n_layers=3, seq_len=16)
BATCH = 4
IMPLEMENTATIONS = ["torch", "fairscale"]


def build() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(CONFIG)


def gradients(model: nn.Module) -> dict[str, Tensor]:
    """Gradients by parameter name, with the checkpoint wrapper's prefix removed."""
    return {
        name.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_checkpointed_blocks_save_only_their_inputs(implementation: str) -> None:
    batch = synthetic_batch("transformer", BATCH, config=CONFIG)

    plain = build()
    plain_bytes, plain_loss = saved_activation_bytes(plain, lambda: loss_fn(plain, batch))
    plain_loss.backward()

    # What one block saves on its own, and how much of that is its input.
    block = build().blocks[0]
    x = torch.randn(BATCH, CONFIG.seq_len, CONFIG.dim, requires_grad=True)
    block_bytes, _ = saved_activation_bytes(block, lambda: block(x))
    input_bytes = x.untyped_storage().nbytes()
    assert block_bytes > 4 * input_bytes  # attention and MLP activations dominate

    checked = checkpoint_layers(build(), Block, implementation=implementation)  # type: ignore[arg-type]
    checked_bytes, checked_loss = saved_activation_bytes(checked, lambda: loss_fn(checked, batch))
    checked_loss.backward()

    assert plain_bytes - checked_bytes == CONFIG.n_layers * (block_bytes - input_bytes)
    assert checked_loss.item() == plain_loss.item()
    plain_grads, checked_grads = gradients(plain), gradients(checked)
    assert plain_grads.keys() == checked_grads.keys()
    assert len(plain_grads) == len(list(plain.parameters()))
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checked_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


class BatchNormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16, momentum=0.1)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.bn(self.fc(x)))


def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), BatchNormBlock(), nn.Linear(16, 1))


def one_training_step(model: nn.Sequential) -> nn.BatchNorm1d:
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    model.train()
    model(x).pow(2).mean().backward()
    bn = model[1].bn
    assert isinstance(bn, nn.BatchNorm1d)
    return bn


def test_fairscale_checkpointing_updates_batchnorm_stats_once() -> None:
    reference = one_training_step(bn_model())
    assert reference.num_batches_tracked.item() == 1

    bn = one_training_step(checkpoint_layers(bn_model(), BatchNormBlock, "fairscale"))  # type: ignore[arg-type]
    assert bn.num_batches_tracked.item() == 1
    torch.testing.assert_close(bn.running_mean, reference.running_mean)
    torch.testing.assert_close(bn.running_var, reference.running_var)


def test_plain_recomputation_updates_batchnorm_stats_twice() -> None:
    reference = one_training_step(bn_model())
    bn = one_training_step(checkpoint_layers(bn_model(), BatchNormBlock, "torch"))  # type: ignore[arg-type]
    assert bn.num_batches_tracked.item() == 2
    # Same batch statistics mu folded in twice from zero: m*mu + (1-m)*m*mu = (2-m) * (m*mu).
    momentum = 0.1
    torch.testing.assert_close(bn.running_mean, (2 - momentum) * reference.running_mean)
    assert not torch.allclose(bn.running_mean, reference.running_mean)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_describe_marks_checkpointed_blocks(implementation: str) -> None:
    model = checkpoint_layers(build(), (Block,), implementation=implementation)  # type: ignore[arg-type]
    lines = describe(model).splitlines()
    marked = [line.strip() for line in lines if "[checkpointed]" in line]
    assert marked == [f"{i}: Block  [checkpointed]" for i in range(CONFIG.n_layers)]
    assert all(is_checkpointed(model.get_submodule(f"blocks.{i}")) for i in range(CONFIG.n_layers))
    assert not is_checkpointed(model.head)


@pytest.mark.parametrize(
    "layers",
    [TinyTransformer, (Block, TinyTransformer), lambda module: isinstance(module, TinyTransformer)],
)
def test_checkpointing_the_root_is_refused(layers: object) -> None:
    model = build()
    with pytest.raises(ValueError, match=r"root module .* is refused.*Select its layers instead"):
        checkpoint_layers(model, layers)  # type: ignore[arg-type]
    assert not any(is_checkpointed(m) for m in model.modules())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"layers": nn.Conv2d}, ValueError, "no module of TinyTransformer matches"),
        ({"layers": "Block"}, TypeError, "layers must be a Module class"),
        ({"layers": (Block, 3)}, TypeError, "LayerPolicy takes nn.Module subclasses"),
        ({"layers": Block, "implementation": "deepspeed"}, ValueError, "choose 'torch' or"),
        ({"layers": Block, "offload_to_cpu": True}, ValueError, "needs implementation='fairscale'"),
    ],
)
def test_bad_checkpointing_arguments(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        checkpoint_layers(build(), **kwargs)  # type: ignore[arg-type]


def test_checkpointing_twice_does_not_nest_wrappers() -> None:
    model = checkpoint_layers(build(), Block)
    checkpoint_layers(model, Block)
    assert checkpointed_names(model, Block) == [f"blocks.{i}" for i in range(CONFIG.n_layers)]
    inner = model.get_submodule("blocks.0._checkpoint_wrapped_module")
    assert isinstance(inner, Block)


def test_saved_tensors_of_a_dropped_graph_are_not_counted() -> None:
    """Only what autograd still keeps when forward returns counts, not what it freed."""
    model = nn.Linear(4, 4)
    x = torch.randn(16, 4)

    def forward_with_a_dropped_branch() -> Tensor:
        out = model(x).relu()
        model(x * 3).exp().sum()  # its graph (x * 3 and the exp output) is freed at once
        return out.sum()

    plain, _ = saved_activation_bytes(model, lambda: model(x).relu().sum())
    with_branch, _ = saved_activation_bytes(model, forward_with_a_dropped_branch)
    assert plain == 2 * 16 * 4 * 4  # the Linear's input and the ReLU's output
    assert with_branch == plain
