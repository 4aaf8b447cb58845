"""build_sharded: a model sharded from the start, with the plain model's weights, never whole."""

from __future__ import annotations

from typing import Any

import meta_build_targets as targets
import pytest
import torch
from torch import nn

from fsdp_guide import launch
from fsdp_guide.errors import MetaInitError
from fsdp_guide.models import MLP
from fsdp_guide.wrap import build_sharded, uninitialisable_modules

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def built() -> list[dict[str, Any]]:
    return launch(targets.built_like_plain, WORLD_SIZE, backend="gloo", start_method="fork")


def test_weights_equal_the_plain_model_built_with_the_same_seed(
    built: list[dict[str, Any]],
) -> None:
    torch.manual_seed(3)
    plain = targets.transformer().state_dict()
    for rank in range(WORLD_SIZE):
        weights = built[rank]["seeded"]
        assert weights.keys() == plain.keys()
        assert all(torch.equal(weights[k], plain[k]) for k in plain)
        assert built[rank]["local_rows"] == 4 * targets.CONFIG.dim // WORLD_SIZE  # sharded


def test_without_a_seed_it_draws_from_the_current_state_and_leaves_it(
    built: list[dict[str, Any]],
) -> None:
    torch.manual_seed(11)
    plain = MLP(8, 16, 2, 4).state_dict()
    for rank in range(WORLD_SIZE):
        assert all(torch.equal(built[rank]["drawn"][k], plain[k]) for k in plain)
        assert built[rank]["rng_untouched"]


def test_no_rank_ever_holds_the_whole_model() -> None:
    peaks = launch(targets.build_peaks, WORLD_SIZE, backend="gloo", start_method="fork")
    model = targets.transformer()
    whole = 4 * sum(p.numel() for p in model.parameters())
    block = 4 * sum(p.numel() for p in model.blocks[0].parameters())
    root = whole - len(model.blocks) * block
    for peak in peaks:
        assert peak["whole"] >= whole  # every rank built the model before sharding it
        assert peak["kept"] == pytest.approx(whole / WORLD_SIZE, abs=64)  # its shards only
        # At most its shards, one whole Block and the root's own tensors at once.
        assert peak["sharded"] <= whole / WORLD_SIZE + block + root + 1024
        assert peak["sharded"] < peak["whole"] * 0.8


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight


def test_modules_that_cannot_be_initialised_are_named_before_anything_is_built() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Scale())
    assert uninitialisable_modules(model) == ["1 (Scale)"]
    with pytest.raises(MetaInitError, match=r"1 \(Scale\).*init='empty'"):
        build_sharded(lambda: nn.Sequential(nn.Linear(4, 4), Scale()))


def test_tied_weights_are_refused() -> None:
    with pytest.raises(MetaInitError, match="tied weights"):
        build_sharded(Tied)


@pytest.mark.parametrize("init", ["random", "", None])
def test_unknown_init_is_refused(init: Any) -> None:
    with pytest.raises(ValueError, match="init must be 'reset' or 'empty'"):
        build_sharded(lambda: nn.Linear(2, 2), init=init)


def test_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="needs a torch.distributed process group"):
        build_sharded(lambda: nn.Linear(2, 2), init="empty")
