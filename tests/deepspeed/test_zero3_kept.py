"""DeepSpeed ZeRO-3 keeps parameters gathered after forward, as the planner says, at 2 ranks.

Each model trains three steps on two gloo ranks (DeepSpeed records its modules' order in
the first and follows it from the second on); in the last, each rank measures what
forward allocated and still holds when it returns, and which parameters are still
gathered. A small model keeps every parameter: all of them are used again in backward,
within ``stage3_max_reuse_distance`` (1e9 elements).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("deepspeed")  # the optional extra; CI installs it

from zero3_targets import after_forward

from fsdp_guide.errors import PlanError
from fsdp_guide.launcher import launch
from fsdp_guide.memory import plan
from fsdp_guide.models import build_model

# (model, engine settings). Without prefetching and with a reuse distance of 1e5 elements,
# only the modules whose next use is that close stay gathered.
CASES = [
    ("transformer", {}),
    ("gpt2", {}),
    ("transformer", {"max_reuse_distance": 100_000, "prefetch_bucket_size": 0}),
]
IDS = [f"{name}{settings or ''}" for name, settings in CASES]
# What forward leaves alive beyond the planned activations and kept parameters: the loss (a
# scalar autograd does not save), transformers' small bookkeeping tensors, and for the demo
# transformer 2,048 bytes that its real forward saves beyond the traced plan (the same
# without DeepSpeed). Keeping no parameter would miss by 4Ψ: 3.4 MB and 116 kB here.
SLACK = 4096  # bytes


@pytest.fixture(scope="module")
def ranks() -> list[list[dict[str, int]]]:
    out: list[list[dict[str, int]]] = launch(
        after_forward, world_size=2, args=(CASES,), start_method="fork"
    )
    return out


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_the_planned_kept_parameters_are_those_gathered(
    ranks: list[list[dict[str, int]]], index: int
) -> None:
    for rank in ranks:
        got = rank[index]
        assert got["gathered"] == got["kept_params"] > 0, got
    every = index != 2  # all but the short reuse distance without prefetch keep them all
    assert (got["kept_params"] == 4 * got["num_params"]) == every, got


# Where every parameter is kept. (Where some are released, autograd still holds the
# gathered weights it saved for backward, which the plan counts neither as activations nor
# as kept parameters.)
@pytest.mark.parametrize("index", range(2), ids=IDS[:2])
def test_what_forward_leaves_alive_is_planned(
    ranks: list[list[dict[str, int]]], index: int
) -> None:
    for rank in ranks:
        got = rank[index]
        planned = got["activations"] + got["kept_params"]
        assert 0 <= got["alive"] - planned <= SLACK, got


def _plan(**settings: int) -> Any:
    return plan(build_model("transformer"), batch_size=2, seq_len=8, world_size=2,
                strategy="deepspeed_zero3", settings=settings)  # fmt: skip


def test_a_shorter_reuse_distance_keeps_only_the_last_modules() -> None:
    every, few = _plan(), _plan(max_reuse_distance=100_000, prefetch_bucket_size=0)
    assert every.kept_params == 4 * every.num_params
    assert 0 < few.kept_params < every.kept_params
    assert few.total < every.total and few.step_peak < every.step_peak
    assert few.as_dict()["kept_params"] == few.kept_params


@pytest.mark.parametrize("setting", ["max_reuse_distance", "prefetch_bucket_size"])
def test_a_negative_threshold_is_named(setting: str) -> None:
    with pytest.raises(PlanError, match=f"{setting} must be an int >= 0 elements, got -1"):
        _plan(**{setting: -1})
