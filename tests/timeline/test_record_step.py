"""record_step in one process: phases, categories, the trace file and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_guide.memory import measure_model_state
from fsdp_guide.timeline import CATEGORIES, PHASES, record_step


def test_a_step_is_recorded_by_category_and_phase(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(128, 64)
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    state = measure_model_state(model, optimizer)
    before = {"params": state.params, "grads": state.grads, "optimizer": state.optimizer}
    trace = tmp_path / "step.json"
    timeline = record_step(
        lambda: model(x).square().mean(),
        lambda loss: loss.backward(),
        optimizer.step,
        state_before=before,
        trace_path=trace,
    )
    assert [name for name, _, _ in timeline.phases] == list(PHASES)
    assert set(timeline.bytes) == set(CATEGORIES)
    split = timeline.peak_split()
    assert split["params"] == state.params and split["optimizer"] == state.optimizer
    # The input of the ReLU and of the second layer are saved: 128 x 256 floats at least.
    assert max(timeline.bytes["activations"]) >= 128 * 256 * 4
    assert max(timeline.bytes["grads"]) == state.params  # every gradient, once
    assert timeline.peak > state.total and timeline.collectives == ()
    assert timeline.categorised
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"fsdp_guide:forward", "fsdp_guide:backward", "[memory]"} <= names


@pytest.mark.parametrize("before", [{"activations": 4}, {"params": -1}])
def test_bad_state_before_is_refused(before: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="state_before takes bytes"):
        record_step(lambda: None, lambda _: None, lambda: None, state_before=before)
