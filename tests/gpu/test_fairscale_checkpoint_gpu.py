"""FairScale FSDP (CUDA only) on one NCCL rank through fsdp_guide.launch, and its checkpoints.

The rank (:func:`gpu_ranks.fairscale_rank`) trains FairScale FSDP beside the unsharded model,
then saves, loads and resumes in both formats; this process, which never touches CUDA,
consolidates the sharded checkpoint and loads both files into a plain CPU model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_ranks import STEPS, fairscale_rank

from fsdp_guide import checkpoint, launch
from fsdp_guide.models import build_model

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fairscale")


@pytest.fixture(scope="module")
def result(work: Path) -> dict[str, Any]:
    (out,) = launch(
        fairscale_rank, 1, args=(str(work),), backend="nccl", start_method="spawn", timeout=240
    )
    return dict(out)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_fairscale_trains_as_the_unsharded_model(result: dict[str, Any]) -> None:
    assert result["device"].startswith("cuda") and "nccl" in result["backend"]
    assert len(result["losses"]) == STEPS
    assert result["losses"] == pytest.approx(result["reference"], rel=1e-4)


@pytest.mark.timeout(300)
def test_fairscale_units_and_state_after_a_step(result: dict[str, Any]) -> None:
    n, units = int(result["num_params"]), result["units"]
    assert len(units) == 5 and sum(units.values()) == n  # a unit per Block plus the root
    state = result["state"]
    # One rank: no padding; Adam's step counter is one 4-byte tensor per flat parameter.
    assert (state["params"], state["grads"], state["optimizer"]) == (
        4 * n,
        4 * n,
        8 * n + 4 * len(units),
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_fairscale_checkpoint_round_trip(result: dict[str, Any], kind: str) -> None:
    saved = result[kind]
    assert _equal(saved["saved"], saved["loaded"])
    assert saved["extra_step"] == 2
    assert saved["resumed"] == pytest.approx(saved["uninterrupted"], rel=1e-5)


@pytest.mark.timeout(300)
def test_fairscale_checkpoints_load_offline_into_a_plain_model(
    result: dict[str, Any], work: Path
) -> None:
    target = work / "consolidated.pt"
    summary = checkpoint.consolidate(result["sharded"]["path"], target)
    assert summary["strategy"] == "fairscale_fsdp"
    for path, kind in ((Path(result["full"]["path"]), "full"), (target, "sharded")):
        plain = build_model("transformer", seed=1)
        checkpoint.load(path, plain, None)  # one process, no process group
        assert _equal(result[kind]["saved"], plain.state_dict())
