"""Pipeline parallelism in the planner, without launching: schedules, bubbles, micro-batches
in flight, the (pp, dp, tp) composition, refusals, and ``estimate``'s options."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_guide.errors import PlanError
from fsdp_guide.memory import pipeline_schedule, pipeline_stages, plan
from fsdp_guide.parallel import TP_PLAN, ParallelConfig, ParallelTransformer

CONFIG = ParallelConfig(dim=32, n_heads=4, n_layers=2, seq_len=8, hidden=64)


def _tokens(batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    return ids, ids.clone()


def _plan(**kwargs: Any) -> Any:
    args: dict[str, Any] = {
        "batch_size": 8,
        "seq_len": CONFIG.seq_len,
        "world_size": 2,
        "strategy": "fsdp2",
        "precision": "fp32",
        "pipeline_parallel": 2,
        "batch": _tokens,
        **kwargs,
    }
    return plan(lambda: ParallelTransformer(CONFIG), **args)


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B"])
@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 2), (2, 4), (2, 8), (4, 1), (4, 4), (4, 8)])
def test_the_simulated_bubble_is_the_textbook_one(name: str, p: int, m: int) -> None:
    """Equal stages, free messages: every rank idles (p - 1) / (v m + p - 1) of the step."""
    if name == "1F1B" and m < p:
        with pytest.raises(PlanError, match="1F1B needs microbatches >= pipeline ranks"):
            pipeline_schedule(name, ranks=p, microbatches=m)
        return
    schedule = pipeline_schedule(name, ranks=p, microbatches=m)
    v = schedule.stages_per_rank
    expected = (p - 1) / (v * m + p - 1)
    assert schedule.formula_bubble == pytest.approx(expected)
    if v > 1 and m < p:  # too few micro-batches to fill the interleaved stages
        assert min(schedule.bubble()) > expected
        return
    assert schedule.bubble() == pytest.approx([expected] * p)


@pytest.mark.parametrize("name", ["InterleavedZeroBubble", "ZBVZeroBubble"])
def test_zero_bubble_schedules_fill_the_bubble_with_weight_gradients(name: str) -> None:
    schedule = pipeline_schedule(name, ranks=4, microbatches=8)
    assert schedule.splits_backward
    interleaved = pipeline_schedule("Interleaved1F1B", ranks=4, microbatches=8)
    assert max(schedule.bubble()) < min(interleaved.bubble())


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_every_rank_runs_every_action_of_its_stages_once(name: str) -> None:
    schedule = pipeline_schedule(name, ranks=4, microbatches=8)
    for rank, actions in enumerate(schedule.actions):
        stages = schedule.rank_stages(rank)
        assert {a.stage for a in actions} == set(stages)
        kinds = ("F", "I", "W") if schedule.splits_backward else ("F", "B")
        want = sorted((s, k, i) for s in stages for k in kinds for i in range(8))
        assert sorted(actions) == want  # type: ignore[comparison-overlap]
    assert sorted(schedule.stage_rank) == sorted(list(range(4)) * schedule.stages_per_rank)


def test_1f1b_holds_at_most_p_minus_s_microbatches_and_gpipe_all() -> None:
    for p, m in ((2, 4), (4, 8)):
        one = pipeline_schedule("1F1B", ranks=p, microbatches=m)
        gpipe = pipeline_schedule("GPipe", ranks=p, microbatches=m)
        for s in range(p):
            assert max(f[s] for f in one.in_flight(s)) == min(m, p - s)
            assert max(f[s] for f in gpipe.in_flight(s)) == m


def test_stage_0_holds_the_most_activations_under_1f1b() -> None:
    sequential = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(8)))

    def batch(b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(b, 16), torch.zeros(b, 16)

    p = plan(
        sequential,
        batch_size=8,
        seq_len=1,
        world_size=4,
        strategy="ddp",
        precision="fp32",
        pipeline_parallel=4,
        microbatches=8,
        batch=batch,
    )
    assert p.pipeline is not None
    peaks = [r.activations for r in p.pipeline.rank_plans]
    assert peaks[:3] == sorted(peaks[:3], reverse=True)  # the last stage adds its loss's
    assert peaks[0] == max(peaks)
    gpipe = plan(
        sequential,
        batch_size=8,
        seq_len=1,
        world_size=4,
        strategy="ddp",
        precision="fp32",
        pipeline_parallel=4,
        microbatches=8,
        schedule="GPipe",
        batch=batch,
    )
    assert gpipe.pipeline is not None
    assert gpipe.pipeline.rank_plans[0].activations > peaks[0]


def test_the_stages_are_the_models_layers() -> None:
    model = ParallelTransformer(CONFIG)
    stages = pipeline_stages(model, 2)
    assert [type(layer).__name__ for stage in stages for layer in stage] == [
        "TokenEmbedding",
        "ParallelBlock",
        "ParallelBlock",
        "OutputHead",
    ]
    assert stages[0][1] is model.blocks[0]  # the model's own modules
    tokens = torch.zeros(2, CONFIG.seq_len, dtype=torch.long)
    torch.testing.assert_close(stages[1](stages[0](tokens)), model(tokens))


def test_each_pipeline_rank_holds_its_stages_state() -> None:
    p = _plan(world_size=4)  # (pp, dp) = (2, 2), FSDP2 on dp
    assert p.pipeline is not None
    whole = sum(t.numel() for t in ParallelTransformer(CONFIG).parameters())
    halves = [
        sum(s.numel() for s in stage.parameters())
        for stage in pipeline_stages(ParallelTransformer(CONFIG), 2)
    ]
    assert sum(halves) == whole
    # FSDP2 over dp = 2: each rank a padded half of its stage's rows.
    for rank in range(4):
        assert p.ranks[rank].params // 4 >= halves[rank // 2] // 2
    assert p.ranks[0].params != p.ranks[2].params


def test_pp_dp_tp_compose() -> None:
    """On a (2, 2, 2) mesh each pipeline rank's ranks hold what tensor parallelism with FSDP2
    plans for its stage alone, and add the stage boundary's messages."""
    p = _plan(world_size=8, tensor_parallel=2, batch_size=4, microbatches=2)
    assert p.pipeline is not None
    stages = pipeline_stages(ParallelTransformer(CONFIG), 2)
    for r, stage in enumerate(stages):
        alone = plan(
            stage,
            batch_size=4,
            seq_len=CONFIG.seq_len,
            world_size=4,
            strategy="fsdp2",
            precision="fp32",
            tensor_parallel=2,
            tp_plan=TP_PLAN,
            batch=_tokens if r == 0 else lambda b, s: (torch.zeros(b, s, 32), None),
        )
        assert p.ranks[4 * r : 4 * r + 4] == alone.ranks
        mine = p.pipeline.rank_plans[r].communication.payload
        assert mine["all_reduce"] == alone.communication.payload["all_reduce"]
        boundary = 4 // 2 * CONFIG.seq_len * CONFIG.dim  # a micro-batch of 2 samples
        assert mine["send"] == mine["recv"] == 2 * boundary


def test_a_stage_without_tensor_parallel_layers_is_replicated() -> None:
    p = _plan(world_size=8, pipeline_parallel=4, tensor_parallel=2, batch_size=4)
    assert p.pipeline is not None
    first = p.pipeline.rank_plans[0].communication.payload  # the embeddings alone
    assert "all_reduce" not in first and first["send"] > 0


def test_p2p_bytes_are_the_boundary_per_microbatch_each_way() -> None:
    p = _plan(microbatches=4)
    assert p.pipeline is not None
    boundary = 2 * CONFIG.seq_len * CONFIG.dim  # 2 samples of 8 tokens of width 32
    assert p.pipeline.boundary_elements[0] == boundary
    for sub in p.pipeline.rank_plans:
        assert sub.communication.payload == {"send": 4 * boundary, "recv": 4 * boundary}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pipeline_parallel": 8, "world_size": 8}, "8 pipeline stages need at least 8 layers"),
        ({"microbatches": 3}, "microbatches=3 does not divide batch_size=8"),
        ({"world_size": 3}, "world_size=3 is not a product of pipeline_parallel=2"),
        ({"schedule": "Zigzag"}, "unknown schedule 'Zigzag'"),
        ({"microbatches": 1}, "1F1B needs microbatches >= pipeline ranks"),
        ({"strategy": "zero1"}, "planned with strategy='fsdp2'"),
        ({"strategy": "ddp", "world_size": 4}, "planned with strategy='fsdp2'"),
        ({"precision": "mixed"}, "planned in fp32"),
        ({"world_size": 4, "settings": {"reshard_after_forward": True}}, "leave the setting"),
        ({"schedule": "ZBVZeroBubble", "stages_per_rank": 3}, "runs 2 stage"),
        ({"schedule": "Interleaved1F1B", "stages_per_rank": 1}, "stages_per_rank must be >= 2"),
        ({"pipeline_parallel": 1, "microbatches": 2}, "microbatches need pipeline_parallel > 1"),
        ({"pipeline_parallel": 0}, "pipeline_parallel must be an int >= 1"),
        # Planned apart, never together yet: refused rather than half-planned.
        ({"world_size": 4, "context_parallel": 2}, "with context_parallel or expert_parallel"),
    ],
)
def test_a_bad_pipeline_request_is_a_plan_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        _plan(**kwargs)


def test_a_model_that_is_no_sequence_of_layers_is_named() -> None:
    from fsdp_guide.models import MLP

    with pytest.raises(PlanError, match="MLP is no nn.Sequential"):
        plan(
            MLP(),
            batch_size=4,
            seq_len=1,
            world_size=2,
            strategy="ddp",
            precision="fp32",
            pipeline_parallel=2,
        )


def test_estimate_plans_a_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_guide.cli import main

    args = ["estimate", "--model", "fsdp_guide.parallel:ParallelTransformer", "--precision"]
    pipeline = ["fp32", "--world-size", "4", "--pipeline-parallel", "2", "--microbatches", "4"]
    assert main([*args, *pipeline, "--schedule", "gpipe", "--batch-size", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    want = plan(
        ParallelTransformer,
        batch_size=8,
        seq_len=16,
        world_size=4,
        strategy="fsdp2",
        precision="fp32",
        pipeline_parallel=2,
        microbatches=4,
        schedule="GPipe",
        batch=_tokens,
    )
    assert rows == [want.as_dict(rank) for rank in range(4)]
    assert [(r["pipeline_rank"], r["stages"], r["schedule"]) for r in rows] == [
        (0, "0", "GPipe"),
        (0, "0", "GPipe"),
        (1, "1", "GPipe"),
        (1, "1", "GPipe"),
    ]


MODEL = ["estimate", "--model", "fsdp_guide.parallel:ParallelTransformer"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*MODEL, "--pipeline-parallel", "2"], "planned in fp32: add --precision fp32"),
        (["estimate", "--params", "7B", "--pipeline-parallel", "2"], "needs a real model"),
        ([*MODEL, "--microbatches", "4"], "pass --pipeline-parallel P"),
        ([*MODEL, "--pipeline-parallel", "2", "--schedule", "zz"], "unknown schedule 'zz'"),
        ([*MODEL, "--pipeline-parallel", "0"], "must be an integer >= 1"),
        (
            [*MODEL, "--precision", "fp32", "--pipeline-parallel", "3", "--world-size", "4"],
            "world_size=4 is not a product of pipeline_parallel=3",
        ),
        (
            [
                *MODEL,
                "--precision",
                "fp32",
                "--pipeline-parallel",
                "8",
                "--world-size",
                "8",
                "--batch-size",
                "8",
            ],
            "8 pipeline stages need at least 8 layers",
        ),
        (
            [
                *MODEL,
                "--precision",
                "fp32",
                "--pipeline-parallel",
                "2",
                "--microbatches",
                "3",
                "--batch-size",
                "8",
            ],
            "microbatches=3 does not divide batch_size=8",
        ),
    ],
)
def test_estimate_refuses_a_bad_pipeline_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    from fsdp_guide.cli import main

    try:
        code = main(argv)
    except SystemExit as exited:  # argparse's own refusals
        code = exited.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_estimate_help_documents_the_pipeline_options(capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_guide.cli import main

    with contextlib.suppress(SystemExit):
        main(["estimate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for option in (
        "--pipeline-parallel P",
        "--microbatches M",
        "--schedule NAME",
        "--stages-per-rank V",
        "ZBVZeroBubble",
    ):
        assert option in out
