"""DeepSpeed in bf16 on gloo: the mixed-precision plan equals the measured state, field by field.

Each catalog DeepSpeed strategy trains two steps with ``zero_config(..., bf16=True)`` on
gloo ranks started by ``fsdp_guide.launch``, on the demo transformer and a tiny GPT-2 from
transformers. Each rank measures its engine after the last ``engine.step()``
(:func:`~fsdp_guide.memory.measure_model_state`) and the test compares every field with
``plan(..., precision="mixed").ranks[rank]``, which must say it is exact. Each rank also sums
every tensor storage that appeared since the engine was built (its batches aside) to show
that nothing outside the measured fields holds memory, and trains the same model in fp32 for
the loss comparison. One launch per world size runs every case, so DeepSpeed is imported
once per rank.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hf_models import SEQ, VOCAB, builder
from torch import nn

pytest.importorskip("deepspeed")  # the optional extra; CI installs it

from fsdp_guide.catalog import STRATEGIES
from fsdp_guide.deepspeed import initialize, zero_config
from fsdp_guide.engines import DeepSpeedZero, engine_for
from fsdp_guide.launcher import launch
from fsdp_guide.memory import measure_model_state, plan
from fsdp_guide.models import build_model, loss_fn, shard_batch, synthetic_batch

pytestmark = pytest.mark.slow

BATCH = 8  # global samples per step, split over the ranks
STEPS = 2
DEEPSPEED = [name for name, spec in STRATEGIES.items() if spec.engine == "deepspeed"]
MODELS = ["transformer", "gpt2"]
STAGES = ["deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"]
# Scalars a ZeRO optimizer keeps beside the state: the last gradient norm, ZeRO-3's overflow flag.
SCALARS = ("_global_grad_norm", "inf_or_nan_tracker")
# The first loss is the same weights' forward in bf16 and fp32; the second follows one Adam
# step of each. bf16 keeps 8 significant bits: the bf16 loss alone is rounded by up to
# 2**-9 of itself (0.2%), and the logits carry a rounding of each layer's matmul inputs and
# outputs on top. 2e-2 allows for ten such roundings adding up (measured here: 6.2e-3 at most).
LOSS_RTOL = 2e-2
Results = dict[tuple[str, str], dict[str, Any]]


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return build_model("transformer") if name == "transformer" else builder(name)()


def _batch(name: str, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "transformer":
        return shard_batch(synthetic_batch("transformer", BATCH, step), rank, world_size)
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return shard_batch((ids, ids.clone()), rank, world_size)


def _storages() -> dict[int, torch.UntypedStorage]:
    """Every storage a live CPU tensor holds, by data pointer (kept alive by the dict, so
    that no later allocation reuses the address)."""
    found: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            found[storage.data_ptr()] = storage
    return found


def _train(
    name: str, strategy: str, rank: int, world_size: int, bf16: bool
) -> tuple[dict[str, int], list[float], int]:
    """Train two steps; the measured state, the losses and the bytes of the tensor storages
    made since the model was built, the optimizer's scalars aside."""
    engine_spec = engine_for(strategy)
    assert isinstance(engine_spec, DeepSpeedZero)
    model = _model(name)
    gc.collect()
    before = _storages()
    config = zero_config(
        engine_spec.stage,
        offload_optimizer=engine_spec.offload_optimizer,
        offload_params=engine_spec.offload_params,
        bf16=bf16,
    )
    engine, optimizer = initialize(model, config)
    losses, batches = [], []
    for step in range(STEPS):
        batches.append(_batch(name, step, rank, world_size))
        loss = loss_fn(engine, batches[-1])
        losses.append(float(loss))
        engine.backward(loss)
        engine.step()
        del loss  # its graph
    gc.collect()
    inputs = {t.untyped_storage().data_ptr() for batch in batches for t in batch}
    new = sum(
        storage.nbytes()
        for ptr, storage in _storages().items()
        if ptr not in before and ptr not in inputs
    )
    del before
    scalars = [getattr(optimizer, attribute, None) for attribute in SCALARS]
    new -= sum(t.untyped_storage().nbytes() for t in scalars if isinstance(t, torch.Tensor))
    measured = measure_model_state(engine, optimizer).as_dict()
    engine.destroy()
    return measured, losses, new


def _run_all(
    rank: int, world_size: int, cases: list[tuple[str, str]], fp32_too: list[tuple[str, str]]
) -> Results:
    """Every case in bf16, and those of ``fp32_too`` in fp32 as well (for their losses)."""
    out: Results = {}
    for name, strategy in cases:
        measured, losses, new = _train(name, strategy, rank, world_size, bf16=True)
        out[(name, strategy)] = {"measured": measured, "losses": losses, "new_storage_bytes": new}
        if (name, strategy) in fp32_too:
            out[(name, strategy)]["fp32_losses"] = _train(
                name, strategy, rank, world_size, bf16=False
            )[1]
    return out


# At 2 ranks every strategy on the demo transformer and the stages without offload on GPT-2;
# at 4 the stages without offload on the demo transformer (the time a test file may take).
CASES = [
    *[(2, "transformer", strategy) for strategy in DEEPSPEED],
    *[(2, "gpt2", strategy) for strategy in STAGES],
    *[(4, "transformer", strategy) for strategy in STAGES],
]
# The loss in bf16 and fp32, at 2 ranks: offloading the optimizer changes no arithmetic.
LOSS_CASES = [(name, strategy) for name in MODELS for strategy in STAGES]


@pytest.fixture(scope="module")
def runs() -> Callable[[int], list[Results]]:
    """The ranks' results at a world size: one launch per world size, on first use."""
    launched: dict[int, list[Results]] = {}

    def at(world_size: int) -> list[Results]:
        if world_size not in launched:
            cases = [(name, strategy) for ws, name, strategy in CASES if ws == world_size]
            launched[world_size] = launch(
                _run_all,
                world_size,
                args=(cases, LOSS_CASES if world_size == 2 else []),
                backend="gloo",
                start_method="fork",
                timeout=600,
            )
        return launched[world_size]

    return at


def _builder(name: str) -> Callable[[], nn.Module]:
    return (lambda: build_model("transformer")) if name == "transformer" else builder(name)


Runs = Callable[[int], list[Results]]


@pytest.mark.parametrize(("world_size", "name", "strategy"), CASES)
def test_mixed_plan_equals_measured_on_every_rank(
    runs: Runs, world_size: int, name: str, strategy: str
) -> None:
    planned = plan(
        _builder(name),
        strategy=strategy,
        world_size=world_size,
        precision="mixed",
        batch_size=BATCH // world_size,
        seq_len=SEQ,
        activations=0,  # not compared here
    )
    assert planned.exact_state
    for rank, by_case in enumerate(runs(world_size)):
        assert planned.ranks[rank].as_dict() == by_case[(name, strategy)]["measured"], rank


@pytest.mark.parametrize(("world_size", "name", "strategy"), CASES)
def test_no_tensor_outside_the_measured_state(
    runs: Runs, world_size: int, name: str, strategy: str
) -> None:
    """Every storage that appeared since the engine was built is in a measured field."""
    for by_case in runs(world_size):
        run = by_case[(name, strategy)]
        assert run["new_storage_bytes"] == run["measured"]["total"]


@pytest.mark.parametrize(("name", "strategy"), LOSS_CASES)
def test_bf16_loss_close_to_fp32(runs: Runs, name: str, strategy: str) -> None:
    for by_case in runs(2):
        run = by_case[(name, strategy)]
        assert run["losses"] != run["fp32_losses"]  # two precisions really ran
        assert run["losses"] == pytest.approx(run["fp32_losses"], rel=LOSS_RTOL)
