"""What pipeline parallelism leaves on each rank of a ``(pp, dp, tp)`` mesh (private).

A pipeline cuts a model that is a sequence of layers (an ``nn.Sequential``, or a model whose
``pipeline_layers()`` returns one) into ``p · v`` contiguous stages; the schedule puts them on
the ``p`` pipeline ranks (:mod:`fsdp_guide.memory._schedule`). Each rank then holds only its
stages' layers, which tensor parallelism may cut further and the data-parallel strategy
shards over ``dp`` ranks, as without a pipeline.

What a pipeline changes, planned from the schedule's own action lists:

- **Activations.** A stage keeps what autograd saves for each micro-batch from its forward
  until its backward frees it (for split backwards: until the weights' half). The peak of a
  rank is the most it holds at once, after some forward: traced on fake tensors for the
  micro-batches then in flight (GPipe holds all ``m``; 1F1B at most ``p - s`` on stage ``s``).
  Storages the micro-batches share, the batch they are views of, count once.
- **Point-to-point messages.** Each forward sends its output to the next stage's rank and each
  backward the gradient of its input to the previous stage's: one micro-batch's boundary
  activation, counted as ``count_collectives`` counts a send and a receive.
- **The data-parallel engine.** FSDP2 on each stage, as torchtitan applies it with a pipeline:
  ``reshard_after_forward=False`` (a micro-batch's forward would gather the stage again) and,
  as torch's pipeline stages run it, no reduce-scatter until the last micro-batch's backward:
  each parameter is gathered once and its gradient reduce-scattered once per step, and the
  stage's gathered parameters and unsharded gradients are held meanwhile. With one data-parallel
  rank no engine wraps the stage: it sends nothing but its messages.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from torch import nn

from fsdp_guide.engines import Engine, UnitPolicy, UnitRule
from fsdp_guide.errors import PlanError
from fsdp_guide.memory._dimensions import RankModel
from fsdp_guide.memory._plan_record import Plan
from fsdp_guide.memory._pp_record import PipelinePlan
from fsdp_guide.memory._pp_trace import (
    boundary_elements,
    stage_boundaries,
    traced_in_flight,
)
from fsdp_guide.memory._request import PlanRequest
from fsdp_guide.memory._schedule import PipelineSchedule, pipeline_schedule

#: The data-parallel strategies a pipeline is planned with (torch's stages run both).
PIPELINE_STRATEGIES = ("ddp", "fsdp2")


def pipeline_layers(model: nn.Module) -> nn.Sequential:
    """The layers a pipeline cuts ``model`` into: an ``nn.Sequential`` as it is, or what the
    model's ``pipeline_layers()`` returns (the same modules, not copies).

    Raises:
        PlanError: For a model that is neither.

    Examples:
        >>> len(pipeline_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU())))
        2
    """
    if isinstance(model, nn.Sequential):
        return model
    layers = getattr(model, "pipeline_layers", None)
    found = layers() if callable(layers) else None
    if not isinstance(found, nn.Sequential):
        raise PlanError(
            f"pipeline parallelism cuts a sequence of layers: {type(model).__name__} is no "
            "nn.Sequential and has no pipeline_layers() returning one; give the model as an "
            "nn.Sequential of its layers"
        )
    return found


def stage_bounds(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` of each stage's layers: contiguous, sizes differing by one at most,
    the larger ones later (early stages hold the most micro-batches in flight).

    Raises:
        PlanError: When there are more stages than layers.

    Examples:
        >>> stage_bounds(6, 4)
        ((0, 1), (1, 3), (3, 4), (4, 6))
    """
    if num_stages > num_layers:
        raise PlanError(
            f"{num_stages} pipeline stages need at least {num_stages} layers; the model has "
            f"{num_layers}: use fewer stages (pipeline_parallel x stages_per_rank)"
        )
    cuts = [s * num_layers // num_stages for s in range(num_stages + 1)]
    return tuple(itertools.pairwise(cuts))


def pipeline_stages(model: nn.Module, stages: int) -> list[nn.Sequential]:
    """``model`` cut into ``stages`` pipeline stages, as :func:`~fsdp_guide.memory.plan` cuts
    it: contiguous runs of its layers, their counts differing by one at most (the larger
    stages last), each an ``nn.Sequential`` of the model's own modules (not copies).

    Args:
        model: An ``nn.Sequential``, or a model whose ``pipeline_layers()`` returns one
            (:class:`fsdp_guide.parallel.ParallelTransformer`: embeddings, blocks, head).
        stages: Stages in all: pipeline ranks times stages per rank.

    Raises:
        PlanError: For a model that is not a sequence of layers, or more stages than layers.

    Examples:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        >>> [len(stage) for stage in pipeline_stages(model, 2)]
        [1, 2]
    """
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise PlanError(f"stages must be an int >= 1, got {stages!r}")
    layers = list(pipeline_layers(model))
    return [nn.Sequential(*layers[a:b]) for a, b in stage_bounds(len(layers), stages)]


def schedule_of(request: PlanRequest) -> PipelineSchedule:
    """The request's schedule on its pipeline ranks."""
    return pipeline_schedule(
        request.schedule,
        ranks=request.pipeline_parallel,
        microbatches=request.microbatches,
        stages_per_rank=request.stages_per_rank,
    )


def stage_modules(request: PlanRequest) -> list[nn.Sequential]:
    """Every stage of the request's model, in order (sharing the model's modules)."""
    return pipeline_stages(request.model, request.pipeline_parallel * request.stages_per_rank)


def pipeline_cut(request: PlanRequest, rank: RankModel) -> RankModel:
    """The stages the request's pipeline rank holds (an ``nn.ModuleList``, in stage order),
    and the messages its schedule sends and receives."""
    if request.pipeline_parallel == 1:
        return rank
    schedule = schedule_of(request)
    stages = stage_modules(request)
    mine = nn.ModuleList(stages[s] for s in schedule.rank_stages(request.pipeline_rank))
    tp_plan = getattr(request.model, "tp_plan", None)
    if tp_plan is not None:  # tensor parallelism reads it next
        mine.tp_plan = tp_plan
    boundaries = boundary_elements(stage_boundaries(request, stages))
    messages = p2p_elements(schedule, boundaries, request.pipeline_rank)
    return replace(rank, model=mine).adding(messages, 2)


def p2p_elements(schedule: PipelineSchedule, boundary: Sequence[int], rank: int) -> dict[str, int]:
    """Elements ``rank`` sends and receives in one step of ``schedule``.

    A forward of stage ``s`` sends its output to stage ``s + 1`` when another rank holds it;
    a backward (or input-gradient) of stage ``s`` sends the gradient of its input, stage
    ``s - 1``'s output, back. Each message is received once.

    Examples:
        >>> schedule = pipeline_schedule("GPipe", ranks=2, microbatches=4)
        >>> p2p_elements(schedule, [10, 99], 0), p2p_elements(schedule, [10, 99], 1)
        ({'send': 40, 'recv': 40}, {'send': 40, 'recv': 40})
    """
    where, last = schedule.stage_rank, schedule.stages - 1
    sent = received = 0
    for action in schedule.actions[rank]:
        s = action.stage
        if action.kind == "F":
            if s < last and where[s + 1] != rank:
                sent += boundary[s]
            if s > 0 and where[s - 1] != rank:
                received += boundary[s - 1]
        elif action.kind in ("B", "I"):
            if s > 0 and where[s - 1] != rank:
                sent += boundary[s - 1]
            if s < last and where[s + 1] != rank:
                received += boundary[s]
    return {"send": sent, "recv": received}


def rank_activations(request: PlanRequest, model: nn.Module) -> tuple[int, dict[int, int]]:
    """The peak bytes of activations on the request's pipeline rank, and the micro-batches
    each of its stages holds then.

    ``model`` is the rank's cut model (its stages, after tensor parallelism). The schedule
    says how many micro-batches each stage holds after each action; a stage's bytes for
    ``k`` of them are ``shared + k · own`` (traced for one and two), which picks the moment;
    the bytes of that moment are traced for its micro-batches together.
    """
    schedule = schedule_of(request)
    rank = request.pipeline_rank
    modules = dict(zip(schedule.rank_stages(rank), model.children(), strict=True))
    bounds = stage_boundaries(request, stage_modules(request))
    one = {s: traced_in_flight(request, modules, {s: 1}, bounds) for s in modules}
    two = {
        s: traced_in_flight(request, modules, {s: 2}, bounds)
        if request.microbatches > 1
        else 2 * one[s]
        for s in modules
    }

    def estimate(held: Mapping[int, int]) -> int:
        # the storages micro-batches share (the batch) once, then each one's own bytes
        return sum(2 * one[s] - two[s] + k * (two[s] - one[s]) for s, k in held.items() if k)

    moments = schedule.in_flight(rank)
    peak = max(moments, key=estimate)  # the first of the fullest
    return traced_in_flight(request, modules, peak, bounds), dict(peak)


class StageLayers:
    """The units FSDP2 makes of a pipeline rank's stages: one per layer, then each stage.

    A unit policy (it has ``select``, as :class:`fsdp_guide.wrap.WrapPolicy` has) for the
    ``nn.ModuleList`` of a rank's stages, as :func:`fsdp_guide.parallel.build_pipeline`
    shards them.
    """

    layer_classes = ()  # read as "a unit per <class>" when the units are said in words

    def select(self, model: nn.Module) -> list[str]:
        return [
            f"{i}.{j}"
            for i, stage in enumerate(model.children())
            for j, _ in enumerate(stage.children())
        ]

    def __repr__(self) -> str:
        return "StageLayers()"

    def for_torch(self) -> Callable[..., bool]:
        raise NotImplementedError("StageLayers plans a pipeline's units; it wraps nothing")

    def for_fairscale(self) -> Callable[..., bool]:
        raise NotImplementedError("StageLayers plans a pipeline's units; it wraps nothing")


def stage_requests(request: PlanRequest) -> list[PlanRequest]:
    """One request per pipeline rank, with the engine that runs on its data-parallel ranks.

    With more than one data-parallel rank, FSDP2 with ``reshard_after_forward=False``, a unit
    per layer; with one, no engine (a plain module with its optimizer).
    """
    from fsdp_guide.engines import Plain

    engine: Engine = Plain()
    policy: UnitRule | UnitPolicy = request.policy
    if request.data_parallel > 1:
        engine = replace(request.engine, **{"reshard_after_forward": False})
        policy = StageLayers()
    return [
        replace(request, pipeline_rank=r, engine=engine, policy=policy)
        for r in range(request.pipeline_parallel)
    ]


def _stage_plan(request: PlanRequest, sub: Plan, peak: int, local_params: int) -> Plan:
    """A pipeline rank's plan with what the pipeline changes: the schedule's activation peak,
    FSDP2 gathering once, and what it holds gathered through the step. Its step peak is a
    bound: the state with its gradients, the activation peak and the gathered stages added."""
    payload = dict(sub.communication.payload)
    kept = ("send", "recv")
    if request.data_parallel == 1:  # no engine: only the pipeline's messages
        payload = {k: v for k, v in payload.items() if k in kept}
    elif "reduce_scatter" in payload:  # gathered once, at the first micro-batch's forward
        payload["all_gather"] = payload["reduce_scatter"]
    groups = {k: v for k, v in sub.communication.group_sizes.items() if k in payload}
    communication = replace(sub.communication, payload=payload, group_sizes=groups)
    transient, kind = 0, "none beyond the state"
    if request.data_parallel > 1:
        per = request.per_param
        transient = (per.params + per.grads) * local_params
        kind = "the stages' parameters gathered and their unsharded gradients, all step"
    return replace(
        sub,
        activations=peak,
        communication=communication,
        transient=transient,
        transient_kind=kind,
        # A bound, not a traced moment: everything the step holds, as if all at once.
        step_peak=sub.state.total + peak + transient,
        step_peak_phase="the schedule's activation peak (a bound)",
        step_peak_kind="state with gradients + activations in flight + gathered stages",
        rank_peaks=(),  # the bound above, the same on each of its ranks
    )


def combine(request: PlanRequest, subs: Sequence[Plan], models: Sequence[nn.Module]) -> Plan:
    """The plan of every rank from one plan per pipeline rank (each over every rank)."""
    schedule = schedule_of(request)
    per = request.world_size // request.pipeline_parallel
    plans, flights = [], []
    for r, (sub, model) in enumerate(zip(subs, models, strict=True)):
        peak, flight = rank_activations(replace(request, pipeline_rank=r), model)
        local = sum(p.numel() for p in model.parameters())
        plans.append(_stage_plan(request, sub, peak, local))
        flights.append(flight)
    ranks = tuple(plans[r // per].ranks[r] for r in range(request.world_size))
    between = tuple(plans[r // per].between_steps[r] for r in range(request.world_size))
    fullest = max(range(len(plans)), key=lambda r: plans[r].total)
    layers = pipeline_layers(request.model)
    bounds = stage_bounds(len(layers), schedule.stages)
    detail = PipelinePlan(
        schedule=schedule,
        layers=tuple(tuple(type(layer).__name__ for layer in list(layers)[a:b]) for a, b in bounds),
        boundary_elements=boundary_elements(stage_boundaries(request, stage_modules(request))),
        peak_in_flight=tuple(flights),
        rank_plans=tuple(plans),
    )
    return replace(
        plans[fullest],
        ranks=ranks,
        between_steps=between,
        pipeline_parallel=request.pipeline_parallel,
        pipeline=detail,
    )
