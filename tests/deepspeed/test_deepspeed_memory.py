"""DeepSpeed engines measured by measure_model_state equal estimate_deepspeed_state, byte for byte.

Every ZeRO stage (0-3) and the CPU offload variants train two steps of torch Adam on gloo
ranks started by ``fsdp_guide.launch``, at world sizes 2 and 4, on the demo transformer and
MLP and on a 23-parameter model whose sizes no world size divides (the demo models divide
evenly, so only this one shows DeepSpeed's padding). Each rank measures its engine after the
last ``engine.step()`` and predicts the same state from the parameter shapes and the config;
the test compares every field. One launch per world size trains every configuration, so
DeepSpeed is imported once per rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")  # the optional extra; CI installs it

from fsdp_guide.engines._deepspeed_state import deepspeed_state_tensors
from fsdp_guide.launcher import launch
from fsdp_guide.memory import (
    ModelState,
    estimate_deepspeed_state,
    measure_model_state,
)
from fsdp_guide.models import build_model, loss_fn, shard_batch, synthetic_batch

pytestmark = pytest.mark.slow

BATCH = 8
BUCKET = 20_000  # elements; small, so that a bucket is not most of the demo model's state
# (label, stage, offload_optimizer, offload_param)
CONFIGS = [
    ("zero0", 0, False, False),
    ("zero1", 1, False, False),
    ("zero2", 2, False, False),
    ("zero3", 3, False, False),
    ("zero1_offload", 1, True, False),
    ("zero2_offload", 2, True, False),
    ("zero3_offload", 3, True, False),
    ("zero3_offload_param", 3, True, True),
]
MODELS = ["transformer", "mlp", "odd"]


def odd_model() -> nn.Module:
    """23 parameters in tensors of 12, 3, 6 and 2: ZeRO-1/2 and ZeRO-3 both pad at N = 2, 4."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _batch(model_name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if model_name != "odd":
        return synthetic_batch(model_name, BATCH, step)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 2, generator=g)


def deepspeed_config(
    world_size: int, stage: int, offload_optimizer: bool = False, offload_param: bool = False
) -> dict[str, Any]:
    """A config for torch's Adam (no compiled op) with small buckets and every tensor sharded."""
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": BUCKET,
        "allgather_bucket_size": BUCKET,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": BUCKET,
    }
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // world_size,
        "gradient_accumulation_steps": 1,
        # adam_w_mode False: torch_adam alone builds AdamW with weight decay.
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False},
        },
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }


def _init_deepspeed() -> Any:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.ops

    # Else init_distributed JIT-compiles a shared-memory op with the C++ compiler.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")  # reuses launch's process group
    return deepspeed


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    storage = tensor.untyped_storage()
    return str(storage.device), storage.data_ptr()


def _measure_all(rank: int, world_size: int) -> dict[tuple[str, str], dict[str, Any]]:
    """Train each (model, config) two steps; measure and predict after the last step."""
    deepspeed = _init_deepspeed()
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for model_name in MODELS:
        for label, stage, offload_optimizer, offload_param in CONFIGS:
            torch.manual_seed(0)
            model = odd_model() if model_name == "odd" else build_model(model_name)  # type: ignore[arg-type]
            numels = [p.numel() for p in model.parameters()]
            config = deepspeed_config(world_size, stage, offload_optimizer, offload_param)
            engine, *_ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=config
            )
            for step in range(2):
                batch = shard_batch(_batch(model_name, step), rank, world_size)
                engine.backward(loss_fn(engine, batch))
                engine.step()
            measured = measure_model_state(engine, engine.optimizer)
            result: dict[str, Any] = {
                "measured": measured,
                "predicted": estimate_deepspeed_state(
                    numels,
                    world_size,
                    stage,
                    reduce_bucket_size=BUCKET,
                    offload_optimizer=offload_optimizer,
                    offload_param=offload_param,
                ),
                # The same engine through its other names.
                "same": [
                    measure_model_state(engine),
                    measure_model_state(engine.module, engine.optimizer),
                    measure_model_state(engine, getattr(engine.optimizer, "optimizer", None)),
                ],
            }
            try:
                measure_model_state(engine, torch.optim.SGD(model.parameters(), lr=0.1))
            except ValueError:
                result["foreign_optimizer_refused"] = True
            if stage > 0:
                tensors = deepspeed_state_tensors(engine.module, engine.optimizer)
                listed = [
                    t
                    for group in tensors.values()
                    for t in group
                    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0
                ]
                storages = {_storage_key(t): t.untyped_storage().nbytes() for t in listed}
                result["listed_tensors"] = len(listed)
                result["distinct_storages"] = len(storages)
                result["distinct_bytes"] = sum(storages.values())
            out[(model_name, label)] = result
            engine.destroy()
            del engine
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict[tuple[str, str], Any]]]:
    world_size: int = request.param
    results = launch(_measure_all, world_size, backend="gloo", start_method="fork", timeout=600)
    return world_size, results


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("label", [c[0] for c in CONFIGS])
def test_measured_equals_predicted(
    ranks: tuple[int, list[dict[tuple[str, str], Any]]], model_name: str, label: str
) -> None:
    world_size, results = ranks
    for rank, by_run in enumerate(results):
        run = by_run[(model_name, label)]
        measured, predicted = run["measured"], run["predicted"]
        assert measured.as_dict() == predicted.as_dict(), (world_size, rank)
        for other in run["same"]:
            assert other == measured
        assert run.get("foreign_optimizer_refused"), "an optimizer the engine does not use"


def test_each_storage_counted_once(ranks: tuple[int, list[dict[tuple[str, str], Any]]]) -> None:
    """Views of one flat buffer (parameters, shards, gradient partitions) add its size once."""
    _, results = ranks
    for by_run in results:
        for key, run in by_run.items():
            if "listed_tensors" not in run:
                continue
            assert run["listed_tensors"] > run["distinct_storages"], key  # views exist
            assert run["measured"].total == run["distinct_bytes"], key


def test_sharding_shows_in_the_prediction() -> None:
    """Pure arithmetic: ZeRO-3's shards shrink with N, ZeRO-1/2 keep full parameters."""
    numels = [1000, 10, 7]
    for world_size in (2, 4, 8):
        z2 = estimate_deepspeed_state(numels, world_size, 2, reduce_bucket_size=1)
        z3 = estimate_deepspeed_state(numels, world_size, 3, reduce_bucket_size=1)
        assert z2.params >= 4 * sum(numels) and z2.master == z2.params // world_size
        assert z3.params == z3.master == z3.grads == 4 * sum(-(-n // world_size) for n in numels)
        assert z3.buckets == 4
    assert isinstance(estimate_deepspeed_state(1017, 2, 1), ModelState)
    with pytest.raises(ValueError, match="offload_param needs ZeRO stage 3"):
        estimate_deepspeed_state(1017, 2, 2, offload_param=True)
    with pytest.raises(ValueError, match="stage must be"):
        estimate_deepspeed_state(1017, 2, 4)


def test_fsdp_guide_does_not_import_deepspeed() -> None:
    """DeepSpeed is an optional extra: the package and its memory module never load it."""
    code = "import sys, fsdp_guide, fsdp_guide.memory; print('deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
