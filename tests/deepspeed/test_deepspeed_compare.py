"""DeepSpeed strategies in ``compare``: measured bytes and collectives equal the predictions.

:func:`~fsdp_guide.memory.predict_model_state` and
:func:`~fsdp_guide.comm.predict_communication` for the DeepSpeed entries must describe what
the engine built from :func:`~fsdp_guide.deepspeed.zero_config` really holds and sends, on
every rank.
"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

from fsdp_guide.catalog import STRATEGIES
from fsdp_guide.compare import run_comparison
from fsdp_guide.memory import predict_model_state

DEEPSPEED = [name for name, spec in STRATEGIES.items() if spec.engine == "deepspeed"]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def rows(request: pytest.FixtureRequest) -> list:  # type: ignore[type-arg]
    return run_comparison(DEEPSPEED, world_size=request.param, steps=3, timeout=300)


@pytest.mark.parametrize("name", DEEPSPEED)
def test_measured_state_equals_the_prediction_on_every_rank(rows: list, name: str) -> None:  # type: ignore[type-arg]
    mine = [row for row in rows if row.strategy == name]
    assert len(mine) == mine[0].world_size
    for row in mine:
        assert row.measured.as_dict() == row.predicted.as_dict(), (name, row.rank)


@pytest.mark.parametrize("name", DEEPSPEED)
def test_collectives_equal_the_prediction_per_kind(rows: list, name: str) -> None:  # type: ignore[type-arg]
    for row in (row for row in rows if row.strategy == name):
        measured = row.comm_measured
        assert measured is not None and measured.complete, measured
        elements = {kind: count.elements for kind, count in measured.kinds.items()}
        assert elements == dict(row.comm_predicted.payload), (name, row.rank)


def test_without_tensor_sizes_the_prediction_is_one_tensor_of_all_parameters() -> None:
    # A RankMeasurement made elsewhere carries no sizes: () must not mean "no parameters".
    def predict(*numels: list[int]) -> object:
        return predict_model_state("deepspeed_zero3", 1000, 4, *numels)

    assert predict([]) == predict() == predict([1000])
    assert predict_model_state("deepspeed_zero3", 1000, 4).params == 4 * 250
