"""Our code adds no warnings to a test run: checkpoint detection and the models' doctests.

Recognising a model's engine (once ``detect_strategy``, now ``engine_for(model, optimizer)``)
imported ``torch.distributed.optim`` to ask whether an optimizer is a
``ZeroRedundancyOptimizer``; that import scripts torch's functional optimizers and printed 66
``torch.jit.script is deprecated`` warnings per fresh process. A doctest of ``loss_fn`` took
``float()`` of a tensor that requires grad, which warns.
"""

from __future__ import annotations

import doctest
import subprocess
import sys
import warnings

import fsdp_guide.models

DETECT = """
import sys, warnings
import torch
from torch import nn
warnings.simplefilter("error")
from fsdp_guide.engines import engine_for
model = nn.Linear(2, 2)
assert engine_for(model, torch.optim.SGD(model.parameters(), lr=0.1)).name == "module"
print("imported:", "torch.distributed.optim" in sys.modules)
"""


def test_detecting_a_plain_optimizer_imports_no_functional_optimizers() -> None:
    done = subprocess.run(
        [sys.executable, "-c", DETECT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "imported: False" in done.stdout


def test_zero_redundancy_optimizer_is_still_detected() -> None:
    with warnings.catch_warnings():
        # Importing it is what scripts the functional optimizers: torch's warnings, not ours.
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer

    from fsdp_guide.engines import engine_for

    class Probe(ZeroRedundancyOptimizer):
        def __init__(self) -> None:  # no process group needed to be an instance
            pass

    assert engine_for(fsdp_guide.models.build_model("mlp"), Probe()).name == "zero1"


def test_models_doctests_warn_nothing() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = doctest.testmod(fsdp_guide.models, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
    assert [str(w.message)[:80] for w in caught] == []
