"""Gradient accumulation over ``k`` micro-steps: what a rank holds and sends (private).

An optimizer step after ``k`` forward-backward passes (micro-steps) trains on ``k`` times the
batch for the memory of one. What it costs depends on when the gradients are reduced:

- **Once, after the last micro-step** (``sync_each_micro_step=False``): DDP's ``no_sync()``
  skips the all-reduce, the gradients (whole on every rank anyway) add up in place. FSDP1's
  ``no_sync()`` and FSDP2's ``set_requires_gradient_sync(False)`` skip the reduce-scatter
  and keep each parameter's **unsharded** gradient until the last micro-step: every rank
  holds the gradients of the whole model, as DDP does. One reduction per optimizer step.
- **Every micro-step** (``sync_each_micro_step=True``): FSDP reduce-scatters after each
  backward and adds the shards: ``1 / N`` of the gradients held, ``k`` reduce-scatters.

Either way the parameters are gathered again in every micro-step (FSDP frees them after
each forward and backward), so all-gathers grow with ``k``. DeepSpeed's
``gradient_accumulation_steps`` decides for itself: ZeRO-1 reduces at the boundary, ZeRO-2
and ZeRO-3 reduce (into their partitions) every micro-step and refuse ``no_sync()``: the
planner plans each DeepSpeed stage (and FairScale's engines) its own way only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsdp_guide.comm import CommPrediction, predict_communication
from fsdp_guide.engines import Engine, model_shape
from fsdp_guide.errors import PlanError
from fsdp_guide.memory._state import ModelState

if TYPE_CHECKING:  # the request imports this module's checks
    from fsdp_guide.memory._dimensions import RankModel
    from fsdp_guide.memory._request import PlanRequest

#: Collective kinds that carry gradients for the engines planned here (DDP's all-reduce,
#: FSDP's reduce-scatter and, with HSDP, the all-reduce of the gradient shards).
GRADIENT_KINDS = ("all_reduce", "reduce_scatter")
#: Engines whose accumulation is planned, and whether they can hold back the reduction.
_ENGINES = ("ddp", "fsdp1", "fsdp2")


@dataclass(frozen=True, kw_only=True)
class Accumulation:
    """What ``k`` micro-steps per optimizer step cost one rank, planned by :func:`plan`.

    Attributes:
        micro_steps: Forward-backward passes per optimizer step (``k``).
        sync_each_micro_step: Whether the gradients are reduced after every micro-step
            (``False``: DDP's and FSDP1's ``no_sync()``, FSDP2's
            ``set_requires_gradient_sync(False)``, on all micro-steps but the last).
        held: Gradient bytes each rank holds between two micro-steps, ``held[r]`` for rank
            ``r``: whole gradients (DDP, and FSDP while the sync is off) or this rank's
            gradient shards (FSDP syncing every micro-step).
        payload: Payload elements per collective kind over one optimizer step (``k``
            micro-steps), as :func:`fsdp_guide.comm.count_collectives` counts them.
        element_size: Bytes per element of ``payload``.
        element_sizes: Bytes per element of a kind sent in another dtype (FSDP2's fp32
            reduce-scatter under bf16 parameters).
    """

    micro_steps: int
    sync_each_micro_step: bool
    held: tuple[int, ...]
    payload: Mapping[str, int]
    element_size: int
    element_sizes: Mapping[str, int] = field(default_factory=dict)

    @property
    def payload_bytes(self) -> dict[str, int]:
        """Bytes per collective kind over one optimizer step."""
        sizes = self.element_sizes
        return {kind: n * sizes.get(kind, self.element_size) for kind, n in self.payload.items()}


def check_accumulation(
    engine: Engine, grad_accumulation: object, sync_each_micro_step: object, mixed: bool
) -> tuple[int, bool]:
    """``grad_accumulation`` and ``sync_each_micro_step``, checked against the engine, and
    the sync resolved: ``None`` is the engine's own way (DDP and ZeRO-1 once per optimizer
    step, FSDP and DeepSpeed ZeRO-2/3 every micro-step).

    Raises:
        PlanError: ``k`` not an int >= 1, a sync flag not a bool or ``None``, a sync the
            engine does not offer (DeepSpeed's and FairScale's accumulation decide it), or
            FSDP1 in mixed precision with the sync off.

    Examples:
        >>> from fsdp_guide.engines import engine_for
        >>> check_accumulation(engine_for("fsdp2"), 4, False, False)
        (4, False)
        >>> check_accumulation(engine_for("fsdp2"), 4, None, False)
        (4, True)
        >>> check_accumulation(engine_for("deepspeed_zero3"), 4, False, False)
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.PlanError: sync_each_micro_step=False is planned for ddp, fsdp1, ...
    """
    k = grad_accumulation
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PlanError(f"grad_accumulation must be an int >= 1 micro-steps, got {k!r}")
    own = bool(engine.syncs_every_microbatch)
    if sync_each_micro_step is None:
        sync_each_micro_step = own
    if not isinstance(sync_each_micro_step, bool):
        raise PlanError(
            f"sync_each_micro_step must be True, False or None, got {sync_each_micro_step!r}"
        )
    if k > 1 and sync_each_micro_step != own and engine.name not in _ENGINES:
        raise PlanError(
            f"sync_each_micro_step={sync_each_micro_step} is planned for "
            f"{', '.join(_ENGINES)} engines, not {engine.name}, which reduces "
            f"{'every micro-step' if own else 'once per optimizer step'} (DeepSpeed: "
            "gradient_accumulation_steps in its config decides); leave it None"
        )
    if k > 1 and not sync_each_micro_step and mixed and engine.name == "fsdp1":
        raise PlanError(
            "FSDP1's no_sync() in mixed precision is not planned: plan it in fp32, or with "
            "sync_each_micro_step=True"
        )
    return k, sync_each_micro_step


def accumulate(
    *,
    micro_steps: int,
    sync_each_micro_step: bool,
    engine: Engine,
    ranks: tuple[ModelState, ...],
    whole_grads: int,
    step_payload: Mapping[str, int],
    gradient_payload: Mapping[str, int],
    element_size: int,
    element_sizes: Mapping[str, int] | None = None,
) -> Accumulation:
    """The :class:`Accumulation` of one optimizer step over ``micro_steps``.

    Args:
        micro_steps: ``k``.
        sync_each_micro_step: Whether every micro-step reduces its gradients.
        engine: The strategy's engine.
        ranks: Each rank's state after the optimizer step (its gradients: shards for FSDP,
            whole for DDP).
        whole_grads: Bytes of the whole (unsharded, unpadded) gradients of one rank's
            model, as the engine keeps them while the sync is off.
        step_payload: Elements per kind of one synced step (the plan's communication).
        gradient_payload: The part of ``step_payload`` that reduces gradients.
        element_size: Bytes per element communicated.
        element_sizes: Bytes per element of kinds sent in another dtype.

    Examples:
        FSDP2 on 2 ranks, 100 parameters: 3 micro-steps with the sync off hold the whole
        gradients and reduce-scatter once; synced, they hold a shard and reduce-scatter 3 times.

        >>> from fsdp_guide.engines import engine_for
        >>> shard = ModelState(params=200, grads=200, optimizer=400)
        >>> step = {"reduce_scatter": 100, "all_gather": 180}
        >>> grads = {"reduce_scatter": 100}
        >>> off = accumulate(micro_steps=3, sync_each_micro_step=False,
        ...     engine=engine_for("fsdp2"), ranks=(shard, shard), whole_grads=400,
        ...     step_payload=step, gradient_payload=grads, element_size=4)
        >>> off.held, dict(off.payload)
        ((400, 400), {'reduce_scatter': 100, 'all_gather': 540})
        >>> on = accumulate(micro_steps=3, sync_each_micro_step=True,
        ...     engine=engine_for("fsdp2"), ranks=(shard, shard), whole_grads=400,
        ...     step_payload=step, gradient_payload=grads, element_size=4)
        >>> on.held, dict(on.payload)
        ((200, 200), {'reduce_scatter': 300, 'all_gather': 540})
    """
    k = micro_steps
    held_back = k > 1 and not sync_each_micro_step
    # Unsharded gradients kept while the sync is off: FSDP's whole model, DDP's as always.
    unsharded = held_back and engine.stage_at_step >= 2
    held = tuple(whole_grads if unsharded else r.grads for r in ranks)
    payload = {kind: k * n for kind, n in step_payload.items()}
    if held_back:
        for kind, n in gradient_payload.items():
            payload[kind] -= (k - 1) * n
    return Accumulation(
        micro_steps=k,
        sync_each_micro_step=sync_each_micro_step,
        held=held,
        payload=payload,
        element_size=element_size,
        element_sizes=dict(element_sizes or {}),
    )


def gradient_payload(request: PlanRequest, rank: RankModel) -> dict[str, int]:
    """Elements per kind that the engine's gradient reductions carry in one synced step."""
    shape = model_shape(rank.model, request.policy, trainable_only=True)
    issued = predict_communication(
        request.strategy,
        shape.num_params,
        request.data_parallel,
        request.comm_dtype,
        shape=shape,
        gpus_per_node=request.gpus_per_node,
        engine=request.engine,
    ).payload
    return {kind: issued.get(kind, 0) for kind in GRADIENT_KINDS if kind in issued}


def plan_accumulation(
    request: PlanRequest,
    rank: RankModel,
    ranks: tuple[ModelState, ...],
    communication: CommPrediction,
) -> Accumulation | None:
    """What ``grad_accumulation`` micro-steps hold and send over one optimizer step, from
    ``communication``, one micro-step's collectives with the gradients reduced; ``None``
    for one micro-step."""
    if request.grad_accumulation == 1:
        return None
    trainable = sum(p.numel() for p in rank.model.parameters() if p.requires_grad)
    # DeepSpeed ZeRO-1 reduces at the boundary and moves its parameters at the step:
    # every collective once per optimizer step.
    once = request.engine.name not in _ENGINES and not request.sync_each_micro_step
    # Held back, FSDP's unsharded gradients are in the dtype it reduces in.
    reduce = 4 if request.reduce_dtype == "fp32" else 2
    element = reduce if request.engine.stage_at_step >= 2 else request.per_param.grads
    return accumulate(
        micro_steps=request.grad_accumulation,
        sync_each_micro_step=request.sync_each_micro_step,
        engine=request.engine,
        ranks=ranks,
        whole_grads=trainable * element,
        step_payload=communication.payload,
        gradient_payload=dict(communication.payload) if once else gradient_payload(request, rank),
        element_size=communication.element_size,
        element_sizes=communication.element_sizes,
    )
