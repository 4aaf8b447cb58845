"""What the optimizer step allocates follows torch's own choice of the foreach path.

torch's Adam steps every tensor at once only when each parameter's type is one it lists
(plain tensors, parameters, DTensors); a ``FlatParameter`` (FSDP1, FairScale FSDP) is not
listed, so those engines step one tensor at a time even on CUDA. An H200 run measured
FairScale FSDP with checkpointing at one rank 0.872 of a plan that assumed the foreach path.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp._flat_param import FlatParameter
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _foreach_supported_types

from fsdp_guide.memory import plan
from fsdp_guide.models import TinyTransformer, TransformerConfig

# Wide and short: the optimizer step, not the activations, sets the peak.
CONFIG = TransformerConfig(vocab_size=64, dim=256, n_heads=4, n_layers=3, seq_len=8)


def _plan(strategy: str, foreach: bool | None) -> int:
    return int(
        plan(
            lambda: TinyTransformer(CONFIG),
            batch_size=1,
            seq_len=CONFIG.seq_len,
            world_size=1,
            strategy=strategy,
            activation_checkpointing="blocks",
            foreach=foreach,
        ).step_peak
    )


def test_torch_takes_its_foreach_path_for_these_types_only() -> None:
    assert torch.nn.Parameter in _foreach_supported_types
    assert DTensor in _foreach_supported_types
    assert FlatParameter not in _foreach_supported_types
    fairscale = pytest.importorskip("fairscale.nn.misc.flatten_params_wrapper")
    assert fairscale.FlatParameter not in _foreach_supported_types


@pytest.mark.parametrize(
    ("strategy", "foreach"),
    [("ddp", True), ("fsdp2", True), ("zero1", True), ("fsdp", False), ("fairscale_fsdp", False)],
)
def test_the_default_plans_torchs_choice(strategy: str, foreach: bool) -> None:
    assert _plan(strategy, None) == _plan(strategy, foreach)
    # The two paths differ here, so the default really picked one.
    assert _plan(strategy, True) != _plan(strategy, False)


def test_a_bad_foreach_names_the_values() -> None:
    with pytest.raises(ValueError, match="foreach must be True, False or None"):
        _plan("fsdp2", "yes")  # type: ignore[arg-type]
