"""Communication per step: count_collectives against predict_communication, every strategy.

"Exact" here means: the payload elements counted per collective kind in one steady-state
training step (the third: construction, the first step's lazy setup and DDP's bucket rebuild
in the second step are not counted) equal the prediction for that kind, and the bytes are the
elements times 4 (fp32). For DDP, OSS, ZeroRedundancyOptimizer, ShardedDDP and FSDP
SHARD_GRAD_OP / NO_SHARD that is Ψ per kind; for FULL_SHARD and FSDP2 the all-gather is
2Ψ - R, where R (the root unit, not gathered again in backward) is computed here from the units.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_guide.catalog import STRATEGIES, cpu_strategies
from fsdp_guide.comm import CommStats, count_collectives, predict_communication
from fsdp_guide.compare import comparison_table, rows_as_json, run_comparison
from fsdp_guide.launcher import launch
from fsdp_guide.memory import measure_model_state
from fsdp_guide.models import build_model, count_params, loss_fn, shard_batch, synthetic_batch

# DeepSpeed engines step through engine.backward/engine.step and hold their state in their own
# buffers: measured and counted in tests/deepspeed/.
CPU_STRATEGIES = cpu_strategies(deepspeed=False)
PSI = count_params(build_model("transformer"))


def _root_units(name: str) -> int:
    """R from the units, computed without the package: what each setup wraps as its root.

    Every fully sharded setup (FSDP1 and FSDP2 alike) makes a unit of each block; the root
    holds the rest.
    """
    model: Any = build_model("transformer")
    return PSI - sum(count_params(block) for block in model.blocks)


def test_prediction_table_and_conventions() -> None:
    ddp = predict_communication("ddp", 1000, 4, torch.float16)
    assert dict(ddp.payload) == {"all_reduce": 1000}
    assert (ddp.payload_bytes, ddp.paper_elements, ddp.convention_elements) == (2000, 2000, 2000)
    assert ddp.wire_elements() == pytest.approx(2 * 3 / 4 * 1000)
    assert dict(predict_communication("sharded_ddp", 10, 2).payload) == {
        "reduce": 10,
        "broadcast": 10,
    }
    zero3 = predict_communication("zero3", 10, 2)
    assert dict(zero3.payload) == {"reduce_scatter": 10, "all_gather": 20}
    assert zero3.paper_elements == zero3.convention_elements == 30
    hybrid = predict_communication("fsdp_hybrid", 100, 4, root_unit_params=100)
    assert dict(hybrid.payload) == {"reduce_scatter": 100, "all_gather": 100, "all_reduce": 50}
    assert hybrid.group_sizes == {"reduce_scatter": 2, "all_gather": 2, "all_reduce": 2}
    for name in STRATEGIES:  # every catalog name has a prediction
        assert predict_communication(name, 8, 2).payload_elements >= 8
    with pytest.raises(ValueError, match="root_unit_params must be between 0 and"):
        predict_communication("fsdp", 10, 2, root_unit_params=11)
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        predict_communication("ddp", 10, 2, "int3")


def test_counting_without_process_group_is_empty_and_stats_wait_for_the_end() -> None:
    with (
        count_collectives() as counter,
        pytest.raises(RuntimeError, match="after the `with count_collectives"),
    ):
        _ = counter.stats
    assert counter.stats == CommStats()


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 4])
def test_measured_payload_equals_prediction_every_strategy(world_size: int) -> None:
    names = CPU_STRATEGIES if world_size == 2 else ["ddp", "oss", "fsdp_hybrid", "fsdp2"]
    rows = run_comparison(names, world_size, steps=3, progress=None, timeout=120)
    assert {row.strategy for row in rows} == set(names)
    for row in rows:
        measured, predicted = row.comm_measured, row.comm_predicted
        assert measured is not None and predicted is not None
        assert measured.complete, (row.strategy, measured.reason)
        assert measured.elements_by_kind() == dict(predicted.payload), row.strategy
        assert measured.bytes == 4 * measured.elements == predicted.payload_bytes
        assert all(c.dtypes == ("torch.float32",) for c in measured.kinds.values())
        if STRATEGIES[row.strategy].zero_stage == 3 and row.strategy != "fsdp_grad_op":
            # Within the root-unit term of the paper's 3Ψ, the term computed from the units.
            gathered = measured.kinds["all_gather"].elements
            if STRATEGIES[row.strategy].settings.get("reshard_after_forward") is False:
                assert gathered == PSI  # kept gathered from forward to backward: once
            else:
                assert gathered == 2 * PSI - _root_units(row.strategy)
            assert PSI <= gathered <= 2 * PSI
    fsdp2 = next(row for row in rows if row.strategy == "fsdp2")
    assert fsdp2.comm_measured is not None
    assert round(fsdp2.comm_measured.kinds["all_gather"].elements / PSI, 3) == 1.919
    data = rows_as_json(rows)
    assert data[0]["comm"]["measured"]["kinds"]["all_reduce"]["calls"] >= 1
    assert "comm/step" in comparison_table(rows)


def _threaded_allreduce_hook(state: object, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook whose all-reduce runs on another thread, as PowerSGD's callbacks do."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    tensor = bucket.buffer()

    def run() -> None:
        dist.all_reduce(tensor)
        future.set_result(tensor.div_(dist.get_world_size()))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return future


# DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
_threaded_allreduce_hook.__annotations__["bucket"] = dist.GradBucket
_threaded_allreduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def _count_with_hook(rank: int, world_size: int, hook: str, all_threads: bool = False) -> CommStats:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    # One bucket: PowerSGD on gloo needs it (see lesson 08).
    model = DistributedDataParallel(build_model("transformer"), bucket_cap_mb=1000)
    if hook == "thread":
        model.register_comm_hook(None, _threaded_allreduce_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(state, psgd.powerSGD_hook)
    before = dist.all_reduce
    for step in range(3):
        batch = shard_batch(synthetic_batch("transformer", 4, step), rank, world_size)
        with count_collectives(all_threads=all_threads) as counter:
            loss_fn(model, batch).backward()  # type: ignore[no-untyped-call]
        model.zero_grad()
    assert dist.all_reduce is before, "count_collectives left torch.distributed patched"
    return counter.stats


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("hook", ["none", "thread", "powersgd"])
def test_collectives_from_other_threads_are_reported_never_silently_short(hook: str) -> None:
    stats = launch(_count_with_hook, 2, args=(hook,), backend="gloo", timeout=120)
    for rank_stats in stats:
        if hook == "none":
            assert rank_stats.complete and rank_stats.unseen_calls == 0
            assert rank_stats.elements_by_kind() == {"all_reduce": PSI}
        elif hook == "thread":  # always on another thread: always reported
            assert not rank_stats.complete
            assert "another thread" in rank_stats.reason
        else:  # PowerSGD's callbacks run inline when the future is done, else on gloo's thread
            assert rank_stats.complete == (rank_stats.unseen_calls == 0)
            assert rank_stats.complete or "another thread" in rank_stats.reason
            assert rank_stats.calls + rank_stats.unseen_calls >= 2  # P and Q of one bucket
        if hook == "thread":  # the one bucket's all-reduce ran on the hook's thread
            assert rank_stats.unseen_calls == 1 and rank_stats.calls == 0


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("hook", ["none", "thread", "powersgd"])
def test_all_threads_counts_what_hook_threads_send(hook: str) -> None:
    stats = launch(_count_with_hook, 2, args=(hook, True), backend="gloo", timeout=120)
    for rank_stats in stats:
        assert rank_stats.complete and rank_stats.unseen_calls == 0, rank_stats.reason
        if hook in ("none", "thread"):  # one bucket, all-reduced whole on either thread
            assert rank_stats.elements_by_kind() == {"all_reduce": PSI}
            assert rank_stats.bytes == 4 * PSI
        else:  # PowerSGD: P and Q of each matrix, and the vectors whole: far less than Ψ
            assert rank_stats.calls >= 2
            assert 0 < rank_stats.elements_by_kind()["all_reduce"] < PSI // 10


def _bucket_state(rank: int, world_size: int, view: bool) -> tuple[int, int, int]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_model("transformer"), gradient_as_bucket_view=view)
    loss_fn(model, shard_batch(synthetic_batch("transformer", 4), rank, world_size)).backward()  # type: ignore[no-untyped-call]
    state = measure_model_state(model)
    return state.grads, state.buckets, state.total


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_gradient_as_bucket_view_saves_one_gradient_copy() -> None:
    (view, _), (copy, _) = (
        launch(_bucket_state, 2, args=(flag,), backend="gloo", timeout=120)
        for flag in (True, False)
    )
    assert view == (4 * PSI, 0, 8 * PSI)
    assert copy == (4 * PSI, 4 * PSI, 12 * PSI)  # the buckets: 3,451,904 B for the demo
