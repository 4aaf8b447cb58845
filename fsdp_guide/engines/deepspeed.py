"""DeepSpeed ZeRO (stages 1-3, offload): DeepSpeed's own layout of the ZeRO stages.

DeepSpeed lays the stages out differently from the ZeRO formulas: stages 1 and 2 keep every
parameter in full *and* an fp32 master copy of the rank's partition of a flat buffer padded
to a multiple of ``2N``; stage 3 a parameter shard per tensor (padded to a multiple of
``N``), a master shard, a gradient buffer kept for the whole run and its reduce bucket;
``engine.step()`` clears the other gradients. Stage 3 does not free every parameter after
its module's forward, as FSDP does: one used again within ``stage3_max_reuse_distance``
elements (1e9 by default: the whole step of a small model) stays gathered into backward
(``DeepSpeedZero.gathered``). Its collectives differ too: stages 1 and 2
all-reduce the whole gradient (not a reduce-scatter) and all-gather the updated partitions;
stage 3 gathers each parameter once per step. DeepSpeed itself is the optional ``deepspeed``
extra, imported only when an engine is built (:mod:`fsdp_guide.deepspeed`).

Examples:
    >>> engine = DeepSpeedZero(stage=2)
    >>> engine.collectives(1001, 2).payload
    {'all_reduce': 1002, 'all_gather': 1004}
    >>> deepspeed_layout([1000, 10], 4, 3, reduce_bucket_size=100)
    Layout(params=253, grads=253, optimizer=253, steps=1, master=253, buckets=100, master_grads=0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

from fsdp_guide.engines._base import Built, Engine, replicated
from fsdp_guide.engines._deepspeed_layout import deepspeed_layout
from fsdp_guide.engines._deepspeed_state import (
    deepspeed_state_tensors,
    engine_optimizer,
    is_deepspeed_engine,
    zero_stage_of,
)
from fsdp_guide.engines._records import Collectives, Layout, Transient
from fsdp_guide.engines._shape import ModelShape
from fsdp_guide.engines._step import Gathered, StepPeak, StepSizes, highest
from fsdp_guide.engines._zero3 import (
    DEFAULT_MAX_LIVE,
    DEFAULT_REUSE_DISTANCE,
    zero3_fetched,
    zero3_gathered,
)

# Private: readers get an engine from fsdp_guide.engines.engine_for, not by its class.
__all__: list[str] = []

#: The prefetch bucket (elements) :func:`fsdp_guide.deepspeed.zero_config` sets.
GUIDE_PREFETCH_BUCKET = 2**16


_STAGE3_KEYS = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "max_live_parameters": "stage3_max_live_parameters",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
}


@dataclass(frozen=True, kw_only=True)
class DeepSpeedZero(Engine):
    """A DeepSpeed engine with torch's Adam (:func:`fsdp_guide.deepspeed.zero_config`).

    In bf16 (:func:`fsdp_guide.deepspeed.zero_config` with ``bf16=True``), which DeepSpeed
    runs on CPU and gloo at stages 1 to 3, those stages keep the ZeRO optimizer they use in
    fp32 (DeepSpeed's bf16-only optimizer comes in at stage 1 only with fp32 gradient
    accumulation, which the guide does not ask for) and ``deepspeed_layout``'s elements,
    at these bytes per element:

    =============================================== =====
    what                                            bytes
    =============================================== =====
    parameters, the offloaded partition to gather   2
    gradient partitions, reduce and staging buckets 2
    fp32 master copy, its offloaded gradient        4
    Adam's two moments (and a 4-byte step)          8
    =============================================== =====

    The ``stage3_*`` settings are DeepSpeed's, in elements (stage 3 only); they default to
    what the guide trains with: :func:`fsdp_guide.deepspeed.zero_config`'s prefetch bucket
    and persistence threshold, DeepSpeed's own reuse distance and live limit.

    Attributes:
        stage: ZeRO stage, 0 to 3 (the catalog names 1 to 3; 0 is data parallelism).
        offload_optimizer: Keep the optimizer state and its step in host memory.
        offload_params: Keep ZeRO-3's parameter shards in host memory too.
        prefetch_bucket_size: ``stage3_prefetch_bucket_size``: elements gathered ahead.
        max_reuse_distance: ``stage3_max_reuse_distance``: a parameter used again within
            this many elements stays gathered.
        max_live_parameters: ``stage3_max_live_parameters``: the prefetcher stops here.
        param_persistence_threshold: ``stage3_param_persistence_threshold``: tensors this
            small are never partitioned (the state still counts their shard).
        model_persistence_threshold: ``stage3_model_persistence_threshold``: at most this
            many elements are persistent.
    """

    name = "deepspeed"
    title = "DeepSpeed"
    mixed_precision = "params"
    fp32_state_when_mixed = False
    sharded_layout = "deepspeed"  # DeepSpeed's own files, by engine.save_checkpoint
    saves_full = False
    stage: int
    offload_optimizer: bool = False
    offload_params: bool = False
    prefetch_bucket_size: int = GUIDE_PREFETCH_BUCKET
    max_reuse_distance: int = DEFAULT_REUSE_DISTANCE
    max_live_parameters: int = DEFAULT_MAX_LIVE
    param_persistence_threshold: int = 0
    model_persistence_threshold: int = 2**63 - 1

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        for name in _STAGE3_KEYS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 elements, got {value!r}")
        if self.offload_params and not (self.stage == 3 and self.offload_optimizer):
            raise ValueError("offload_params needs stage=3 and offload_optimizer=True")

    @classmethod
    def recognises(cls, model: nn.Module, optimizer: object) -> bool:
        return is_deepspeed_engine(model) or zero_stage_of(optimizer) is not None

    @classmethod
    def from_model(cls, model: nn.Module, optimizer: object) -> Engine:
        engine: Any = model
        if is_deepspeed_engine(model):
            return cls(stage=int(engine.zero_optimization_stage()))
        if zero_stage_of(optimizer) == 3:
            return cls(stage=3)
        # One ZeRO-1/2 optimizer class for both stages: stage 2 partitions the gradients.
        return cls(stage=2 if getattr(optimizer, "partition_gradients", False) else 1)

    def build(self, model: nn.Module, *, device: torch.device, world_size: int, lr: float) -> Built:
        from fsdp_guide.deepspeed import initialize, zero_config

        config = zero_config(
            self.stage,
            lr=lr,
            offload_optimizer=self.offload_optimizer,
            offload_params=self.offload_params,
        )
        if self.stage == 3:  # the thresholds the planner follows, handed to DeepSpeed
            config["zero_optimization"].update(
                {key: getattr(self, name) for name, key in _STAGE3_KEYS.items()}
            )
        engine, optimizer = initialize(model, config)
        return engine, cast(torch.optim.Optimizer, optimizer)

    @property
    def stage_at_step(self) -> int:
        return self.stage

    def own_formula(self, param_numels: Sequence[int], world_size: int) -> Layout:
        from fsdp_guide.deepspeed import BUCKET_ELEMENTS

        return deepspeed_layout(
            list(param_numels),
            world_size,
            self.stage,
            reduce_bucket_size=BUCKET_ELEMENTS,
            offload_optimizer=self.offload_optimizer,
            offload_param=self.offload_params,
        )

    def layout(
        self, shapes: Sequence[Sequence[int]], world_size: int, *, fp32_adam: bool = True
    ) -> tuple[Layout, ...] | None:
        if not fp32_adam:  # measured for fp32 Adam only
            return None
        numels = [math.prod(shape) for shape in shapes]
        return replicated(world_size, self.own_formula(numels, world_size))

    def mixed_layout(
        self, shapes: Sequence[Sequence[int]], world_size: int
    ) -> tuple[Layout, ...] | None:
        """The fp32 layout: bf16 changes DeepSpeed's bytes per element, not its elements.

        Stage 0 (not a catalog row) trains bf16 with another optimizer, not measured: None.

        Examples:
            >>> DeepSpeedZero(stage=3).mixed_layout([(1000,), (10,)], 4)[0].master
            253
            >>> DeepSpeedZero(stage=0).mixed_layout([(1000,), (10,)], 4) is None
            True
        """
        return None if self.stage == 0 else self.layout(shapes, world_size)

    def host_layout(self, layout: Layout) -> Layout:
        """What offload keeps in host memory, as DeepSpeed allocates it.

        ``offload_optimizer``: the fp32 master copy, its gradient, Adam's state and step;
        at stages 1 and 2 also the 16-bit partition the step writes for the all-gather and
        one of the two staging buffers of the largest tensor (the other is on the
        accelerator); at stage 3 also the gradient partitions. ``offload_params``: ZeRO-3's
        16-bit parameter shards. The reduce bucket stays on the accelerator.

        Examples:
            >>> one = deepspeed_layout([1000, 10], 4, 2, offload_optimizer=True)
            >>> host = DeepSpeedZero(stage=2, offload_optimizer=True).host_layout(one)
            >>> (host.params, host.master, host.buckets), (one.params, one.buckets)
            ((254, 254, 1000), (1270, 2000))
        """
        if not self.offload_optimizer:
            return super().host_layout(layout)
        moved = Layout(
            params=0,
            grads=layout.grads if self.stage == 3 else 0,
            optimizer=layout.optimizer,
            steps=layout.steps,
            master=layout.master,
            master_grads=layout.master_grads,
        )
        if self.stage == 3:
            return replace(moved, params=layout.params if self.offload_params else 0)
        # Stages 1 and 2: the partition waiting for the all-gather, a staging buffer.
        return replace(moved, params=layout.master, buckets=layout.buckets // 2)

    @property
    def steps_on_host(self) -> bool:
        return self.offload_optimizer

    @property
    def syncs_every_microbatch(self) -> bool:  # type: ignore[override]
        """ZeRO-2 and 3 reduce every micro-batch's gradients; 0 and 1 at the boundary."""
        return self.stage >= 2

    @property
    def grads_between_steps(self) -> bool:
        """ZeRO-3 keeps its gradient partitions and reduce bucket for the whole run."""
        return self.stage == 3

    def stepped_tensors(self, shape: ModelShape, world_size: int) -> list[int]:
        """The rank's flat fp32 partition (stages 1-3), which torch's Adam steps as one tensor.

        Examples:
            >>> DeepSpeedZero(stage=3).stepped_tensors(ModelShape(units=(((1000,), (10,)),)), 4)
            [253]
        """
        if self.stage == 0:
            return super().stepped_tensors(shape, world_size)
        numels = [math.prod(s) for s in shape.shapes]
        return [self.own_formula(numels, world_size).master]

    @property
    def step_gradient_fields(self) -> tuple[str, ...]:
        """The step makes an fp32 gradient of the master partition (ZeRO-1 to 3); stage 0
        is torch's optimizer over the gradients."""
        return ("master",) if self.stage else ("grads",)

    def gathered(self, sizes: StepSizes, world_size: int) -> Gathered | None:
        """ZeRO-3: the parameters left gathered when forward returns, and as backward starts.

        A module's parameters stay gathered after its forward when it runs again within
        ``max_reuse_distance`` elements of parameters (its backward comes after every later
        module's forward and backward), when the prefetcher has walked past their next use,
        or when they are persistent; backward's first modules then gather and prefetch up
        to ``prefetch_bucket_size`` elements more. So a small model keeps every parameter
        gathered through the end of forward, and a large one only its last modules'.
        ``None`` for stages 0-2, which keep their parameters whole anyway, and where the
        modules are not known.

        Each module is taken to run once, children in registration order. With a short
        reuse distance *and* prefetching, the prefetcher runs ahead of forward into
        backward; DeepSpeed then gathers fewer parameters again than this counts (an upper
        bound there).

        Examples:
            >>> from torch import nn
            >>> from fsdp_guide.engines import module_calls
            >>> def sizes(model: nn.Module) -> StepSizes:
            ...     calls = module_calls(model)
            ...     psi = calls.num_params
            ...     return StepSizes(params=4 * psi, grads=4 * psi, largest_unit=0,
            ...                      largest_unit_grads=0, root_unit=0, activations=0,
            ...                      calls=calls)
            >>> small = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
            >>> engine = DeepSpeedZero(stage=3)
            >>> engine.gathered(sizes(small), 2).after_forward == 4 * 4 * (64 * 64 + 64)
            True
            >>> # 8 layers of 268M elements: the last 2 are used again within 1e9 elements
            >>> # (forward's end and backward's start); backward prefetches a third
            >>> with torch.device("meta"):
            ...     large = nn.Sequential(*(nn.Linear(2**14, 2**14) for _ in range(8)))
            >>> kept = engine.gathered(sizes(large), 2)
            >>> kept.after_forward // (4 * (2**28 + 2**14)), kept.peak // (4 * (2**28 + 2**14))
            (2, 3)
        """
        if self.stage != 3 or sizes.calls is None or sizes.calls.num_params == 0:
            return None
        if world_size == 1:  # a rank's partition is the whole parameter: nothing to gather
            return Gathered(after_forward=0, peak=0, kind="nothing gathered at one rank")
        per = sizes.params // sizes.calls.num_params  # bytes per gathered element
        after_forward, peak = zero3_gathered(
            sizes.calls,
            prefetch_bucket=self.prefetch_bucket_size,
            reuse_distance=self.max_reuse_distance,
            max_live=self.max_live_parameters,
            param_threshold=self.param_persistence_threshold,
            model_threshold=self.model_persistence_threshold,
        )
        return Gathered(
            after_forward=per * after_forward,
            peak=per * peak,
            kind="parameters gathered for reuse within stage3_max_reuse_distance, prefetched",
        )

    def step_peak(self, sizes: StepSizes, world_size: int) -> StepPeak:
        """ZeRO-3: forward's activations with the parameters still gathered when it ends,
        backward's with those gathered as it starts (:meth:`gathered`; every parameter
        where the modules are not known), and the optimizer step, which makes an fp32
        gradient of the master partition (:attr:`StepSizes.step_grads`) and allocates the
        optimizer's temporaries. ZeRO-0/1/2: every activation and every gradient, an upper
        bound (DeepSpeed reduces and frees gradients bucket by bucket while backward frees
        activations), or the optimizer step.

        Examples:
            >>> sizes = StepSizes(params=1000, grads=1000, largest_unit=200,
            ...                   largest_unit_grads=200, root_unit=200, activations=500)
            >>> DeepSpeedZero(stage=3).step_peak(sizes, 2).bytes
            1500
        """
        if self.stage != 3:
            return super().step_peak(sizes, world_size)
        gathered = self.gathered(sizes, world_size)
        after_forward = sizes.params if gathered is None else gathered.after_forward
        at_backward = sizes.params if gathered is None else gathered.peak
        forward = StepPeak(
            bytes=sizes.forward_peak + after_forward,
            phase="forward",
            kind="activations + parameters kept gathered for reuse",
        )
        backward = StepPeak(
            bytes=sizes.backward_activations + at_backward,
            phase="backward",
            kind="activations + parameters gathered for reuse and prefetched",
        )
        return highest(
            forward, backward, sizes.optimizer_step(kind="the master partition's fp32 gradient")
        )

    def transient(
        self, *, param_bytes: int, grad_bytes: int, num_params: int, largest_unit: int
    ) -> Transient:
        """ZeRO-3 where the modules' order is not known: the largest gathered unit. (The
        planner reads :meth:`gathered` instead when it knows them.)"""
        if self.stage == 3:
            return Transient(
                bytes=(param_bytes + grad_bytes) * largest_unit,
                kind="largest gathered unit (params + grads)",
            )
        return Transient(bytes=0, kind="none known beyond the state")

    def collectives(
        self, num_params: int, world_size: int, root_unit_params: int = 0
    ) -> Collectives:
        if self.stage == 3:  # gathered once per step; the all-reduce is the overflow check
            return Collectives(
                payload={"reduce_scatter": num_params, "all_gather": num_params, "all_reduce": 1}
            )
        if self.stage == 0:  # not a catalog row: data parallelism's all-reduce, not measured
            return Collectives(payload={"all_reduce": num_params})
        padded = -(-num_params // (2 * world_size)) * 2 * world_size
        return Collectives(payload={"all_reduce": num_params + 1, "all_gather": padded})

    def step_collectives(self, shape: ModelShape, world_size: int) -> Collectives:
        """ZeRO-3 pads each tensor to a multiple of the ranks, and gathers what its parameter
        coordinator fetches over the step (:func:`zero3_fetched`, where the modules' order
        is known): each parameter once while the model is below ``max_reuse_distance`` and
        the live limit, and again in backward what forward released past them.

        Examples:
            >>> shape = ModelShape(units=(((3,), (4,)),))
            >>> DeepSpeedZero(stage=3).step_collectives(shape, 2).payload
            {'reduce_scatter': 8, 'all_gather': 8, 'all_reduce': 1}
            >>> from torch import nn
            >>> from fsdp_guide.engines import model_shape
            >>> two = model_shape(nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100)))
            >>> [DeepSpeedZero(stage=3, max_reuse_distance=d, prefetch_bucket_size=0)
            ...  .step_collectives(two, 2).payload["all_gather"] for d in (10**9, 10**4)]
            [20200, 30300]
        """
        if self.stage != 3:
            return super().step_collectives(shape, world_size)
        numels = [math.prod(s) for s in shape.shapes]
        padded = sum(-(-n // world_size) * world_size for n in numels)
        issued = self.collectives(padded, world_size)
        calls = shape.calls
        if calls is None or world_size == 1 or sorted(calls.numels) != sorted(numels):
            return issued
        fetched = zero3_fetched(
            calls,
            prefetch_bucket=self.prefetch_bucket_size,
            reuse_distance=self.max_reuse_distance,
            max_live=self.max_live_parameters,
            param_threshold=self.param_persistence_threshold,
            model_threshold=self.model_persistence_threshold,
        )
        gathered = sum(-(-calls.numels[p] // world_size) * world_size for p in fetched)
        return Collectives(payload={**issued.payload, "all_gather": gathered})

    def optimizer_of(self, module: nn.Module, optimizer: object) -> Any:
        return engine_optimizer(module, optimizer) if is_deepspeed_engine(module) else optimizer

    def state_tensors(self, module: nn.Module, optimizer: object) -> dict[str, list[Any]] | None:
        if zero_stage_of(optimizer) is None:  # ZeRO-0: torch's optimizer, walked as usual
            return None
        return deepspeed_state_tensors(module, optimizer)

    def train_step(self, module: nn.Module, optimizer: Any, loss: torch.Tensor) -> None:
        from fsdp_guide.deepspeed import backward_and_step

        backward_and_step(module, optimizer, loss)

    def zero_grad(self, module: nn.Module, optimizer: Any) -> None:
        """Nothing: ``engine.step()`` has zeroed the gradients already."""
