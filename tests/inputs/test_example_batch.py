"""The example batch read from a model, and the loss taken from whatever the model returns."""

from __future__ import annotations

from typing import Any

import pytest
import tiny_hf
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_guide.errors import PlanError
from fsdp_guide.inputs import example_batch, parse_input
from fsdp_guide.memory import plan
from fsdp_guide.models import loss_fn

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "vit", "cnn"])
def test_the_batch_trains_the_real_model(name: str) -> None:
    """Built outside fake tensors the batch is real: one forward and backward runs on it."""
    torch.manual_seed(0)
    model = tiny_hf.BUILDERS[name]()
    loss = loss_fn(model, example_batch(model).build(2, 8))
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_the_model_s_own_loss_when_labels_are_given() -> None:
    torch.manual_seed(0)
    model = tiny_hf.gpt2().eval()  # no dropout: two forwards give the same loss
    inputs, targets = example_batch(model).build(2, 8)
    assert targets is None and torch.equal(inputs["labels"], inputs["input_ids"])
    assert torch.equal(loss_fn(model, (inputs, None)), model(**inputs).loss)
    # Without labels: the logits, with cross-entropy against the targets given.
    ids, next_ids = torch.randint(0, 128, (2, 8)), torch.randint(0, 128, (2, 8))
    logits = model(input_ids=ids).logits
    want = F.cross_entropy(logits.reshape(-1, 128), next_ids.reshape(-1))
    assert torch.allclose(loss_fn(model, ({"input_ids": ids}, next_ids)), want)


class _LossFirst(nn.Module):
    """Returns ``(loss, logits)`` as transformers models do with ``return_dict=False``."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(x)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return (loss, logits) if loss is not None else (logits,)


def test_tuple_outputs() -> None:
    model, x, labels = _LossFirst(), torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    with_labels = loss_fn(model, ({"x": x, "labels": labels}, None))
    assert torch.equal(with_labels, F.cross_entropy(model.head(x), labels))
    # (logits,): the first tensor is the output, and the targets give its loss.
    assert torch.equal(loss_fn(model, ((x,), labels)), with_labels)


def test_keyword_only_encoder_decoder() -> None:
    """T5 needs decoder inputs as keywords; the batch has both sides."""
    model = tiny_hf.t5()
    batch = example_batch(model)
    inputs, _ = batch.build(3, 5)
    assert {k: tuple(v.shape) for k, v in inputs.items()} == {
        "input_ids": (3, 5),
        "attention_mask": (3, 5),
        "decoder_input_ids": (3, 5),
        "labels": (3, 5),
    }
    assert inputs["attention_mask"].eq(1).all()


def test_images_sized_from_the_config() -> None:
    from transformers import ResNetConfig, ResNetForImageClassification

    vit = example_batch(tiny_hf.vit()).build(2, 99)[0]
    assert vit["pixel_values"].shape == (2, 3, 16, 16) and vit["labels"].shape == (2,)
    with torch.device("meta"):  # ResNet's config has no image_size: ImageNet's 224
        resnet = ResNetForImageClassification(ResNetConfig(hidden_sizes=[8], depths=[1]))
    assert example_batch(resnet).description.startswith("pixel_values:float32[B,3,224,224]")


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        return self.a(x) + self.b(y), "extras"


def test_stated_inputs_and_a_tuple_output() -> None:
    model = _TwoHeads()
    with pytest.raises(PlanError, match=r"2 required inputs \(x, y\); state each with --input"):
        example_batch(model)
    specs = [parse_input("x:float32[B,4]"), parse_input("y:float32[B,4]")]
    p = plan(model, batch_size=2, seq_len=1, world_size=2, strategy="ddp",
             batch=example_batch(model, specs).build)  # fmt: skip
    assert p.activations > 0


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ("text", "returned str, not a tensor, tuple or ModelOutput"),
        (torch.zeros(2, 3, dtype=torch.long), "returned a torch.int64 tensor"),
        ({"last_hidden_state": torch.zeros(2, 3)}, "no loss or logits; plan the model with a"),
    ],
)
def test_outputs_without_a_loss_are_plan_errors(returned: Any, message: str) -> None:
    class Returns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> Any:
            return returned

    with pytest.raises(PlanError, match=message):
        loss_fn(Returns(), (torch.zeros(2, 2), None))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("input_ids", "cannot read 'input_ids' as an input"),
        ("input_ids:long[B,S]", "unknown dtype 'long'"),
        ("input_ids:int64[B,T]", "dimension 'T' of 'input_ids:int64\\[B,T\\]' must be B, S"),
        ("input_ids:int64[B,0]", "dimension '0'"),
    ],
)
def test_bad_input_specs(text: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        parse_input(text)


def test_plain_modules_from_their_first_layer() -> None:
    conv = nn.Sequential(nn.Conv1d(2, 4, 3), nn.Flatten())
    assert example_batch(conv).description.startswith("input:float32[B,2,224]")
    assert example_batch(nn.Embedding(9, 4)).description.startswith("input:int64[B,S]")
    with pytest.raises(PlanError, match="cannot tell what LayerNorm.forward's 'input' is"):
        example_batch(nn.LayerNorm(4))


def test_a_model_that_states_its_own_batch() -> None:
    # The tensor-parallel model of fsdp_guide.parallel has example_batch(B, S); the CLI's
    # --tensor-parallel plans read it through example_batch like any other model.
    from fsdp_guide.parallel import ParallelTransformer

    model = ParallelTransformer()
    batch = example_batch(model)
    inputs, targets = batch.build(2, 8)
    assert batch.uses_seq_len and "example_batch" in batch.description
    expected_inputs, expected_targets = model.example_batch(2, 8)
    assert (inputs.shape, targets.shape) == (expected_inputs.shape, expected_targets.shape)
