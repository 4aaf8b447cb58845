"""What a DeepSpeed ZeRO-3 rank holds when forward returns, measured and planned (run in ranks)."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from dataclasses import replace

import hf_models
import torch
from torch import Tensor, nn

from fsdp_guide.deepspeed import backward_and_step
from fsdp_guide.engines import engine_for
from fsdp_guide.memory import plan, track_allocations
from fsdp_guide.models import build_model, loss_fn, shard_batch, synthetic_batch

BATCH = 4  # samples per rank
STEPS = 3  # DeepSpeed records the modules' order in the first step and follows it after


def _case(
    name: str, rank: int
) -> tuple[Callable[[], nn.Module], Callable[[int], tuple[Tensor, Tensor]], int]:
    """A builder of ``name``, this rank's batch of a step, and the sequence length."""
    if name == "transformer":
        return (
            lambda: build_model("transformer"),
            lambda step: shard_batch(synthetic_batch("transformer", 2 * BATCH, step), rank, 2),
            32,
        )
    make = hf_models.batch_fn(name)
    return hf_models.builder(name), lambda step: make(BATCH, hf_models.SEQ), hf_models.SEQ


def after_forward(
    rank: int, world_size: int, cases: list[tuple[str, dict[str, int]]]
) -> list[dict[str, int]]:
    """For each model and engine settings, in the last of ``STEPS`` steps: the bytes forward
    allocated that are alive when it returns, the bytes of the parameters still gathered
    then (each storage once), and the plan's activations and kept parameters."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    warnings.filterwarnings("ignore")
    out = []
    for name, settings in cases:
        build, batch, seq = _case(name, rank)
        engine = replace(engine_for("deepspeed_zero3"), **settings)
        module, optimizer = engine.build(build(), device=torch.device("cpu"), world_size=2, lr=1e-3)
        nets = []
        for step in range(STEPS):
            data = batch(step)
            with track_allocations() as seen:
                loss = loss_fn(module, data)
                # Forward leaves ~0.3 MB of cyclic garbage (DeepSpeed's hook objects), freed
                # whenever the collector next runs: not held, so not planned.
                gc.collect()
            if step:  # from the second step on, DeepSpeed follows the order it recorded
                nets.append(seen.net)
            storages = {
                p.data.untyped_storage().data_ptr(): p.data.untyped_storage().nbytes()
                for p in module.parameters()
                if p.ds_status != ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
            }
            backward_and_step(module, optimizer, loss)
        planned = plan(
            build,
            batch_size=BATCH,
            seq_len=seq,
            world_size=world_size,
            strategy="deepspeed_zero3",
            settings=settings,
            batch=None if name == "transformer" else hf_models.batch_fn(name),
        )
        inputs = sum(t.untyped_storage().nbytes() for t in data)
        out.append(
            {
                # A release on gloo's worker thread can go unseen and only adds to a step's
                # net: the lowest of the steps that follow the recorded order.
                "alive": min(nets) + inputs,  # the plan counts the inputs as activations
                "gathered": sum(storages.values()),
                "activations": planned.activations,
                "kept_params": planned.kept_params,
                "num_params": planned.num_params,
            }
        )
        del module, optimizer
        torch.manual_seed(0)
    return out


def sent_per_step(
    rank: int, world_size: int, cases: list[tuple[str, dict[str, int]]]
) -> list[dict[str, dict[str, int]]]:
    """For each model and ZeRO-3 settings: the payload elements per collective kind of the
    last of ``STEPS`` steps (forward, backward and ``engine.step()``), measured, and what the
    planner plans for the same run."""
    from fsdp_guide.comm import count_collectives

    warnings.filterwarnings("ignore")
    out = []
    for name, settings in cases:
        build, batch, seq = _case(name, rank)
        engine = replace(engine_for("deepspeed_zero3"), **settings)
        module, optimizer = engine.build(build(), device=torch.device("cpu"), world_size=2, lr=1e-3)
        for step in range(STEPS):
            data = batch(step)
            with count_collectives() as counted:
                backward_and_step(module, optimizer, loss_fn(module, data))
        planned = plan(
            build,
            batch_size=BATCH,
            seq_len=seq,
            world_size=world_size,
            strategy="deepspeed_zero3",
            settings=settings,
            batch=None if name == "transformer" else hf_models.batch_fn(name),
        )
        out.append(
            {
                "measured": counted.stats.elements_by_kind(),
                "planned": dict(planned.communication.payload),
                "complete": {"yes": int(counted.stats.complete)},
            }
        )
        del module, optimizer
        torch.manual_seed(0)
    return out
