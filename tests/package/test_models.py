"""The demo models' and data's argument checks."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import fsdp_guide
from fsdp_guide.launcher._checks import check_world_size
from fsdp_guide.models import MODEL_NAMES, build_model, check_model_name, synthetic_batch


@pytest.mark.parametrize("name", ["resnet", "MLP", "", None, 3])
@pytest.mark.parametrize("check", [check_model_name, build_model, synthetic_batch])
def test_every_model_name_check_says_the_same(
    check: Callable[[object], object], name: object
) -> None:
    with pytest.raises(ValueError, match=r"^unknown model .*; choose 'transformer' or 'mlp'$"):
        check(name)


def test_model_names_are_the_literal_type() -> None:
    assert MODEL_NAMES == ("transformer", "mlp")
    assert [check_model_name(name) for name in MODEL_NAMES] == list(MODEL_NAMES)


@pytest.mark.parametrize("world_size", [0, -2, 1.0, "2", True, None])
@pytest.mark.parametrize(
    "check",
    [
        check_world_size,
        lambda world_size: fsdp_guide.launch(print, world_size),
        lambda world_size: fsdp_guide.launcher.dist_init(0, world_size),
    ],
)
def test_every_world_size_check_says_the_same(
    check: Callable[[object], object], world_size: object
) -> None:
    with pytest.raises(ValueError, match=r"^world_size must be an int >= 1, got "):
        check(world_size)
