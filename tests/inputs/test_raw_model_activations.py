"""The activations planned for a model as ``estimate --model`` gets it (the transformers model
itself, its example batch read from its config, its own output turned into the loss) equal
what autograd saves when that model runs forward on a real batch of the same shapes."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import BUILDERS

from fsdp_guide.inputs import example_batch
from fsdp_guide.memory import traced_activation_bytes
from fsdp_guide.models import loss_fn
from fsdp_guide.wrap import saved_activation_bytes

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize(("batch_size", "seq_len"), [(2, 16), (3, 8)])
def test_the_plan_of_a_raw_model_saves_what_its_forward_saves(
    name: str, batch_size: int, seq_len: int
) -> None:
    torch.manual_seed(0)
    model = BUILDERS[name]()
    data = example_batch(model).build(batch_size, seq_len)
    real, loss = saved_activation_bytes(model, lambda: loss_fn(model, data))
    assert loss.ndim == 0 and real > 0
    assert traced_activation_bytes(model, batch_size, seq_len) == real
