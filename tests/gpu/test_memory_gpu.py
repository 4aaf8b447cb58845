"""FairScale FSDP (CUDA only): measured bytes on one GPU with NCCL. Skipped without CUDA."""

from __future__ import annotations

import pytest

from fsdp_guide.compare._runs import run_comparison, train_and_measure
from fsdp_guide.launcher import launch
from fsdp_guide.models import build_model, count_params

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_fairscale_fsdp_measured_bytes_on_one_gpu() -> None:
    (result,) = launch(
        train_and_measure,
        1,
        args=("fairscale_fsdp", "transformer", 2, 8),
        backend="nccl",
        start_method="spawn",
    )
    n = count_params(build_model("transformer"))
    state = result.state
    # One flat parameter (no padding on one rank): fp32 params and grads, Adam's two
    # moments and one step counter.
    assert (state.params, state.grads, state.optimizer) == (4 * n, 4 * n, 8 * n + 4)
    assert result.peak.kind == "cuda_peak_allocated"
    assert result.peak.bytes >= state.total


@pytest.mark.timeout(300)
def test_compare_runs_fairscale_fsdp_with_cuda_peak() -> None:
    rows = run_comparison(["fairscale_fsdp", "fsdp"], world_size=1, steps=2, progress=None)
    by_name = {row.strategy: row for row in rows}
    assert by_name["fairscale_fsdp"].peak_kind == "cuda_peak_allocated"
    for row in rows:
        assert abs(row.ratio - 1) < 0.02
    assert by_name["fairscale_fsdp"].loss == pytest.approx(by_name["fsdp"].loss, rel=1e-4)
