"""The names of the tensors FSDP hangs on a parameter, each engine's own, checked against the
libraries' sources."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch import nn

from fsdp_guide.engines import FSDP1, GRAD_BUFFERS, PARAM_BUFFERS, FairScaleFSDP, local_tensor
from fsdp_guide.memory import _measure, measure_model_state
from fsdp_guide.wrap import _activations, saved_activation_bytes

# Attributes FairScale sets on a parameter that are bookkeeping, not tensors holding data.
_FAIRSCALE_BOOKKEEPING = {"_is_sharded", "_orig_size", "_is_shared", "_shard_bwd_hook"}


def _torch_flat_param_buffers() -> dict[str, str]:
    """Each Tensor attribute of FSDP1's FlatParameter and its documented meaning."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    tensors = [n for n, t in FlatParameter.__annotations__.items() if t in (torch.Tensor, "Tensor")]
    doc = inspect.getdoc(FlatParameter) or ""
    meanings = {}
    for name in tensors:
        # "    _name (Tensor): meaning", up to the next attribute or a blank line.
        pattern = rf"^\s*{name} \(Tensor\): (.*?)(?=^\s*_\w+ \(|\n\s*\n|\Z)"
        found = re.search(pattern, doc, re.M | re.S)
        assert found, f"FlatParameter no longer documents {name}"
        meanings[name] = " ".join(found.group(1).split())
    return meanings


def _fairscale_param_attributes() -> tuple[set[str], set[str]]:
    """(tensor attributes FairScale's FSDP sets on a parameter, those it makes ``p.grad``)."""
    from fairscale.nn.data_parallel import fully_sharded_data_parallel

    source = inspect.getsource(fully_sharded_data_parallel)
    assigned = set(re.findall(r"\b(?:p|param)\.(_\w+) = ", source))
    made_grad = set(re.findall(r"\b(?:p|param)\.grad = (?:p|param)\.(_\w+)\b", source))
    return assigned - _FAIRSCALE_BOOKKEEPING, made_grad


def test_parameter_and_gradient_buffers_are_apart() -> None:
    assert not set(PARAM_BUFFERS) & set(GRAD_BUFFERS)


def test_torch_fsdp1_buffers_are_classified_as_documented() -> None:
    meanings = _torch_flat_param_buffers()
    assert {"_local_shard", "_cpu_grad"} <= set(meanings)  # the parsing found them
    for name, meaning in meanings.items():
        expected = FSDP1.grad_buffers if "gradient" in meaning.lower() else FSDP1.param_buffers
        assert name in expected, f"FlatParameter.{name}: {meaning}"


def test_fairscale_buffers_are_classified_as_fairscale_uses_them() -> None:
    assigned, made_grad = _fairscale_param_attributes()
    assert made_grad == {"_cpu_grad", "_saved_grad_shard"}
    assert set(FairScaleFSDP.grad_buffers) == made_grad
    for name in assigned:
        expected = FairScaleFSDP.grad_buffers if name in made_grad else FairScaleFSDP.param_buffers
        assert name in expected, f"FairScale sets p.{name}"


def test_the_lists_are_every_engine_s_together() -> None:
    assert set(PARAM_BUFFERS) == {*FSDP1.param_buffers, *FairScaleFSDP.param_buffers}
    assert set(GRAD_BUFFERS) == {*FSDP1.grad_buffers, *FairScaleFSDP.grad_buffers}


@pytest.mark.parametrize("consumer", [_measure, _activations])
def test_memory_and_wrap_use_the_one_list(consumer: object) -> None:
    # Two copies of the list disagreed about _cpu_grad before; both read this one now.
    assert getattr(consumer, "PARAM_BUFFERS", None) is PARAM_BUFFERS
    own = [
        name
        for name, value in vars(consumer).items()
        if isinstance(value, tuple)
        and value not in (PARAM_BUFFERS, GRAD_BUFFERS)
        and any("_shard" in str(item) for item in value)
    ]
    assert not own, f"{consumer} keeps a list of its own: {own}"


def test_a_cpu_gradient_buffer_counts_as_gradients_not_parameters() -> None:
    layer = nn.Linear(4, 4, bias=False)  # 64 bytes
    layer.weight._cpu_grad = torch.zeros(4, 4)  # type: ignore[attr-defined]
    state = measure_model_state(layer)
    assert (state.params, state.grads) == (64, 64)


def test_a_saved_parameter_shard_is_not_an_activation() -> None:
    layer = nn.Linear(4, 4, bias=False)
    shard = torch.randn(16)
    layer.weight._fp32_shard = shard  # type: ignore[attr-defined]
    x = torch.randn(2, 4, requires_grad=True)

    def forward() -> torch.Tensor:
        # Saves x (32 bytes), the weight and a view of the shard (64 bytes, a parameter).
        return (layer(x) * shard.view(4, 4)[:2]).sum()

    nbytes, _ = saved_activation_bytes(layer, forward)
    assert nbytes == 32


def _dtensor_shard_sizes(rank: int, world_size: int) -> tuple[int, int, int]:
    """(elements of this rank's shard, parameter bytes measured, activation bytes measured)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    module = nn.Module()  # a parameter of 8 floats, sharded: each of 2 ranks holds 4
    module.weight = nn.Parameter(distribute_tensor(torch.ones(8), mesh, [Shard(0)]))
    x = distribute_tensor(torch.randn(8), mesh, [Shard(0)]).requires_grad_()
    # Autograd saves both factors: x (an activation) and the weight (a parameter).
    activations, _ = saved_activation_bytes(module, lambda: (module.weight * x).sum())
    params = measure_model_state(module).params
    return local_tensor(x).numel(), params, activations


def test_dtensors_count_the_local_shard_only() -> None:
    from fsdp_guide import launch

    results = launch(_dtensor_shard_sizes, 2, backend="gloo", start_method="fork", timeout=120)
    # Each rank holds 4 of 8 floats of the input and of the weight: 16 bytes of each.
    assert results == [(4, 16, 16), (4, 16, 16)]
