"""PyTorch FSDP1 (``FullyShardedDataParallel``): one flat parameter per unit, cut in equal chunks.

Each unit's parameters are flattened into one ``FlatParameter``, padded to a multiple of the
shard group and cut into equal chunks; Adam sees one tensor per unit. The sharding strategy
decides what is kept after the step: ``FULL_SHARD`` and ``SHARD_GRAD_OP`` hold stage-3 state
there (``SHARD_GRAD_OP`` is ZeRO-2 only between forward and backward, when it keeps every
unit gathered), ``NO_SHARD`` stage-0 state, and ``HYBRID_SHARD`` shards within groups of
``shard_group`` ranks and all-reduces each shard across the groups.

Examples:
    >>> FSDP1(sharding_strategy="SHARD_GRAD_OP").stage_at_step
    3
    >>> hybrid = FSDP1(sharding_strategy="HYBRID_SHARD", shard_group=2)
    >>> hybrid.shard_group_size(4), hybrid.collectives(100, 4, 100).payload
    (2, {'reduce_scatter': 100, 'all_gather': 100, 'all_reduce': 50})
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from fsdp_guide.engines._base import Built, adam, fully_sharded, replicated
from fsdp_guide.engines._checkpoint import TorchStateDict
from fsdp_guide.engines._records import Collectives, Layout, Transient
from fsdp_guide.engines._shape import ModelShape
from fsdp_guide.engines._step import StepPeak, StepSizes, highest
from fsdp_guide.engines._units import (
    UNIT_RULES,
    UnitEngine,
    UnitPolicy,
    UnitRule,
    UnitView,
    unit_names,
)

# Private: readers get an engine from fsdp_guide.engines.engine_for, not by its class.
__all__: list[str] = []

ShardingStrategyName = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]


def _fsdp1_class() -> type[nn.Module]:
    """``torch.distributed.fsdp.FullyShardedDataParallel``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


@dataclass(frozen=True, kw_only=True)
class FSDP1(TorchStateDict, UnitEngine):
    """PyTorch FSDP1 with Adam, a unit per transformer block when built for a strategy.

    Attributes:
        sharding_strategy: A ``torch.distributed.fsdp.ShardingStrategy`` name.
        shard_group: Ranks per shard group, for ``HYBRID_SHARD`` only (when the world
            divides by it; else one group of every rank).
        wrap: ``"blocks"``: a unit per transformer block
            (:func:`~fsdp_guide.engines.block_classes`), then the root; ``"root"``: the
            whole model one unit.
        backward_prefetch: ``"BACKWARD_PRE"`` (the default: gather the next unit before the
            current one computes its gradients), ``"BACKWARD_POST"`` (after), or ``None``
            (no prefetch in backward).
        forward_prefetch: Gather the next unit before the current one's forward.
        limit_all_gathers: At most two units' all-gathers in flight (a CUDA rate limiter;
            it changes nothing on CPU).
    """

    name = "fsdp1"
    title = "PyTorch FSDP1 (FullyShardedDataParallel)"
    maintenance = 1
    mixed_precision = "params"
    flat_parameters = True
    aliases = ("torch",)  # shard()'s name for it before the catalog named every engine
    # On the FlatParameter: its shard, a low-precision copy of the shard, the padded
    # gathered parameter (FlatParamHandle.init_flat_param_attributes); gradient shards.
    param_buffers = (
        "_local_shard",
        "_mp_shard",
        "_full_param_padded",
        "_full_prec_full_param_padded",
    )
    grad_buffers = ("_saved_grad_shard", "_cpu_grad")

    sharded_layout = "dcp"
    loads_dcp = True
    full_optimizer_keys = "name"

    sharding_strategy: ShardingStrategyName = "FULL_SHARD"
    shard_group: int | None = None
    wrap: UnitRule = "blocks"
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST"] | None = "BACKWARD_PRE"
    forward_prefetch: bool = False
    limit_all_gathers: bool = True

    def __post_init__(self) -> None:
        choices = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
        if self.sharding_strategy not in choices:
            raise ValueError(
                f"unknown sharding_strategy {self.sharding_strategy!r}; choose one of "
                f"{', '.join(choices)}"
            )
        if (self.shard_group is not None) != self.hybrid:
            raise ValueError(
                "shard_group is the size of HYBRID_SHARD's groups: give it with "
                f"sharding_strategy='HYBRID_SHARD' and only then, got {self!r}"
            )
        if self.wrap not in UNIT_RULES:
            raise ValueError(f"unknown wrap {self.wrap!r}; choose one of {', '.join(UNIT_RULES)}")
        if self.shard_group is not None and (
            isinstance(self.shard_group, bool) or self.shard_group < 1
        ):
            raise ValueError(f"shard_group must be an int >= 1, got {self.shard_group!r}")
        if self.backward_prefetch not in ("BACKWARD_PRE", "BACKWARD_POST", None):
            raise ValueError(
                f"backward_prefetch must be 'BACKWARD_PRE', 'BACKWARD_POST' or None, "
                f"got {self.backward_prefetch!r}"
            )

    @property
    def hybrid(self) -> bool:
        """Whether it shards within groups and replicates across them."""
        return self.sharding_strategy == "HYBRID_SHARD"

    @classmethod
    def recognises(cls, model: nn.Module, optimizer: object) -> bool:
        return isinstance(model, _fsdp1_class())

    def build(self, model: nn.Module, *, device: torch.device, world_size: int, lr: float) -> Built:
        from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

        kwargs: dict[str, Any] = {}
        if self.hybrid:
            from torch.distributed.device_mesh import init_device_mesh

            shard = self.shard_group_size(world_size)
            # A 2-D mesh (replicate, shard): no GPU-count guessing, so it runs on gloo too.
            kwargs["device_mesh"] = init_device_mesh(
                device.type, (world_size // shard, shard), mesh_dim_names=("replicate", "shard")
            )
        names = set(unit_names(model, self.wrap))
        if names:  # the modules of those names, as FSDP1 walks the model

            def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
                return recurse or id(module) in chosen

            chosen = {id(model.get_submodule(name)) for name in names}
            kwargs["auto_wrap_policy"] = policy
        module = _fsdp1_class()(
            model,
            device_id=device,
            sharding_strategy=ShardingStrategy[self.sharding_strategy],
            backward_prefetch=(
                BackwardPrefetch[self.backward_prefetch] if self.backward_prefetch else None
            ),
            forward_prefetch=self.forward_prefetch,
            limit_all_gathers=self.limit_all_gathers,
            **kwargs,
        )
        return module, adam(module.parameters(), lr)

    @property
    def stage_at_step(self) -> int:
        return 0 if self.sharding_strategy == "NO_SHARD" else 3

    def shard_group_size(self, world_size: int) -> int:
        if self.shard_group is not None and world_size % self.shard_group == 0:
            return self.shard_group
        return world_size

    def layout(
        self, shapes: Sequence[Sequence[int]], world_size: int, *, fp32_adam: bool = True
    ) -> tuple[Layout, ...] | None:
        """One flat parameter for the whole model, cut into chunks of ``ceil(Ψ / group)``.

        Examples:
            >>> FSDP1().layout([(10,), (7,)], 2)[0]  # 17 elements padded to 18
            Layout(params=9, grads=9, optimizer=9, steps=1, master=0, buckets=0, master_grads=0)
        """
        total = sum(math.prod(shape) for shape in shapes)
        group = self.shard_group_size(world_size)
        flat = math.ceil(total / group) if self.stage_at_step >= 3 else total
        return replicated(world_size, Layout(params=flat, grads=flat, optimizer=flat, steps=1))

    def shape_layout(
        self, shape: ModelShape, world_size: int, *, fp32_adam: bool = True
    ) -> tuple[Layout, ...] | None:
        """A flat parameter per unit with parameters, each padded and cut on its own.

        Examples:
            >>> shape = ModelShape(units=(((3,),), ((5,),), ((5,),)))
            >>> FSDP1().shape_layout(shape, 2)[0]  # flat params of 4, 6 and 6: chunks 2+3+3
            Layout(params=8, grads=8, optimizer=8, steps=3, master=0, buckets=0, master_grads=0)
        """
        sizes = [sum(math.prod(s) for s in unit) for unit in shape.units]
        sizes = [size for size in sizes if size]  # a unit without parameters has none
        # NO_SHARD keeps each unit's flat parameter whole: no padding, a step per unit.
        group = self.shard_group_size(world_size) if self.stage_at_step >= 3 else 1
        flat = sum(-(-size // group) for size in sizes)
        one = Layout(params=flat, grads=flat, optimizer=flat, steps=len(sizes))
        return replicated(world_size, one)

    def stepped_tensors(self, shape: ModelShape, world_size: int) -> list[int]:
        """Each unit's flat parameter shard (whole at one rank or with ``NO_SHARD``).

        Examples:
            >>> FSDP1().stepped_tensors(ModelShape(units=(((3,),), ((5, 2),))), 2)
            [2, 5]
        """
        sizes = [sum(math.prod(s) for s in unit) for unit in shape.units]
        group = self.shard_group_size(world_size) if self.stage_at_step >= 3 else 1
        return [-(-size // group) for size in sizes if size]

    def step_peak(self, sizes: StepSizes, world_size: int) -> StepPeak:
        """The most a step holds beyond the state kept between steps, moment by moment.

        With the activations traced over the step (:attr:`StepSizes.stretches`), the
        largest of forward (its activations, the root, the running block), each block's
        backward (its activations, the root, the blocks gathered, the last block's unsharded
        gradients as they replace its activations, the sharded gradients of the blocks
        done: FSDP1 waits for each reduce-scatter before the next block), and the
        optimizer step (the sharded gradients, the optimizer's temporaries). ``NO_SHARD``,
        which FSDP1 also runs at one rank: the gradients kept as they come, as one process
        does. Without a traced profile, the moments of :meth:`_untraced_peak`.

        Examples:
            >>> from fsdp_guide.engines import Stretch
            >>> sizes = StepSizes(params=1000, grads=1000, largest_unit=200,
            ...                   largest_unit_grads=200, root_unit=200, activations=300,
            ...                   blocks=4, stretches=(
            ...     Stretch(unit=False, start=300, peak=320, grads=0, largest_grad=0),
            ...     Stretch(unit=True, start=280, peak=300, grads=200, largest_grad=200),
            ...     Stretch(unit=True, start=210, peak=230, grads=200, largest_grad=200)))
            >>> FSDP1().step_peak(sizes, 2).bytes  # 280 + 200 + root + 2 blocks
            1080
            >>> FSDP1().step_peak(sizes, 1).bytes  # as one process: 230 + 200 + 200
            630
        """
        if not sizes.stretches or (self.sharding_strategy == "SHARD_GRAD_OP" and world_size > 1):
            return self._untraced_peak(sizes, world_size)
        step = sizes.optimizer_step()
        if self.stage_at_step == 0 or world_size == 1:
            return highest(sizes.piled(), step)
        unit, grads, root = sizes.largest_unit, sizes.largest_unit_grads, sizes.root_unit
        blocks = (2 if self.backward_prefetch == "BACKWARD_PRE" else 1) + self.forward_prefetch
        gathered = root + blocks * unit
        shard = grads // world_size
        forward = StepPeak(bytes=0, phase="forward", kind="")
        for stretch in sizes.forward:
            running = root + ((1 + self.forward_prefetch) * unit if stretch.unit else 0)
            if stretch.peak + running > forward.bytes:
                forward = StepPeak(
                    bytes=stretch.peak + running,
                    phase="forward",
                    kind="activations + root + the blocks gathered",
                )
        best = StepPeak(bytes=0, phase="backward", kind="")
        for j, stretch in enumerate(sizes.units_backward):
            own = max(stretch.peak, stretch.start + grads) if j == 0 else stretch.peak
            held = own + gathered + j * shard + sizes.head_grads
            if held > best.bytes:
                best = StepPeak(
                    bytes=held,
                    phase="backward",
                    kind=f"a block's backward: activations + root + {blocks} gathered "
                    "block(s) + its gradients + the shards done",
                )
        return highest(forward, best, step)

    def _untraced_peak(self, sizes: StepSizes, world_size: int) -> StepPeak:
        """The peak of a step with a unit per block (``shard(model, policy=LayerPolicy(Block))``).

        At the start of backward: every activation, the root's parameters, the blocks
        gathered at once and one block's unsharded gradients. ``backward_prefetch`` decides
        how many blocks: two with ``"BACKWARD_PRE"`` (the running one and the next), one with
        ``"BACKWARD_POST"`` or ``None``; ``forward_prefetch`` adds one. ``SHARD_GRAD_OP``
        keeps every block gathered from forward to backward (peak at the end of forward).
        A model with no blocks is one unit: the larger of the start of backward (activations
        and the gathered parameters) and its end (the parameters, the unsharded flat gradient
        and its padded copy to reduce-scatter). ``NO_SHARD``: as DDP.

        Examples:
            >>> sizes = StepSizes(params=1000, grads=1000, largest_unit=200,
            ...                   largest_unit_grads=200, root_unit=200, activations=500)
            >>> [FSDP1(backward_prefetch=b).step_peak(sizes, 2).bytes
            ...  for b in ("BACKWARD_PRE", None)]
            [1300, 1100]
            >>> one = StepSizes(params=1000, grads=1000, largest_unit=1000,
            ...                 largest_unit_grads=1000, root_unit=1000, activations=500)
            >>> FSDP1().step_peak(one, 2).bytes
            3000
        """
        if self.stage_at_step == 0:
            return super().step_peak(sizes, world_size)
        a, unit = sizes.activations, sizes.largest_unit
        if sizes.root_unit >= sizes.params:  # one unit, the whole model
            start, end = a + sizes.params, sizes.params + 2 * sizes.grads
            kind = "activations + every parameter gathered"
            if end > start:
                kind = "gathered parameters + unsharded gradient + its copy to reduce-scatter"
            return StepPeak(bytes=max(start, end), phase="backward", kind=kind)
        if self.sharding_strategy == "SHARD_GRAD_OP":
            return StepPeak(
                bytes=a + sizes.params + unit,
                phase="forward",
                kind="activations + every parameter gathered + one all-gather buffer",
            )
        blocks = (2 if self.backward_prefetch == "BACKWARD_PRE" else 1) + self.forward_prefetch
        return StepPeak(
            bytes=a + sizes.root_unit + blocks * unit + sizes.largest_unit_grads,
            phase="backward",
            kind=f"activations + root + {blocks} gathered block(s) + a block's gradients",
        )

    def transient(
        self, *, param_bytes: int, grad_bytes: int, num_params: int, largest_unit: int
    ) -> Transient:
        if self.sharding_strategy == "SHARD_GRAD_OP":
            # It keeps every unit gathered from its forward until backward ends.
            return Transient(
                bytes=param_bytes * num_params + grad_bytes * largest_unit,
                kind="all parameters gathered (forward to backward) + a unit's grads",
            )
        if self.stage_at_step >= 3:
            return Transient(
                bytes=(param_bytes + grad_bytes) * largest_unit,
                kind="largest gathered unit (params + grads)",
            )
        # A flat parameter's gradient is concatenated from its parameters' gradients, which
        # autograd holds until the unit's last one arrives; it is then all-reduced in place.
        return Transient(
            bytes=grad_bytes * largest_unit, kind="a unit's gradients before they are flattened"
        )

    def collectives(
        self, num_params: int, world_size: int, root_unit_params: int = 0
    ) -> Collectives:
        if self.sharding_strategy == "NO_SHARD":
            return Collectives(payload={"all_reduce": num_params})
        if self.sharding_strategy == "SHARD_GRAD_OP":  # gathered once, kept until backward
            return Collectives(payload={"reduce_scatter": num_params, "all_gather": num_params})
        shard = self.shard_group_size(world_size)
        sharded = fully_sharded(num_params, shard, root_unit_params)
        if not self.hybrid:
            return sharded
        # Each gradient shard is all-reduced across the replicas, even when there is one.
        return Collectives(
            payload={**sharded.payload, "all_reduce": num_params // shard},
            groups={**sharded.groups, "all_reduce": world_size // shard},
        )

    def step_collectives(self, shape: ModelShape, world_size: int) -> Collectives:
        """Each unit's flat parameter padded to a multiple of the shard group.

        Examples:
            >>> shape = ModelShape(units=(((3,),), ((5,),), ((5,),)))  # a root and 2 units
            >>> FSDP1().step_collectives(shape, 2).payload  # flat params of 4, 6 and 6
            {'reduce_scatter': 16, 'all_gather': 28}
        """
        if self.sharding_strategy == "NO_SHARD":
            return super().step_collectives(shape, world_size)
        group = self.shard_group_size(world_size)
        flat = [-(-sum(math.prod(s) for s in unit) // group) * group for unit in shape.units]
        padded = self.collectives(sum(flat), world_size, flat[0] if flat else 0)
        if not self.hybrid:
            return padded
        payload = {**padded.payload, "all_reduce": sum(flat) // group}
        return Collectives(payload=payload, groups=padded.groups)

    def root_unit_params(self, module: nn.Module) -> int:
        if not isinstance(module, _fsdp1_class()):
            return 0
        handle: Any = module._handle
        return int(sum(handle.flat_param._numels)) if handle is not None else 0

    def gather_to_rank0(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Gathered into rank 0 only, one unit at a time, on CPU as on GPU (host memory).

        DCP ties FSDP1's rank-0-only mode to offloading, which on CPU frees the storage FSDP1
        is reading: FSDP1's own API does it, offloading only from a GPU.
        """
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            StateDictType,
        )

        fsdp = _fsdp1_class()
        on_gpu = any(p.is_cuda for p in model.parameters())
        with fsdp.state_dict_type(  # type: ignore[attr-defined]
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=on_gpu, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=on_gpu, rank0_only=True),
        ):
            model_state = model.state_dict()
            optim_state = (
                fsdp.optim_state_dict(model, optimizer)  # type: ignore[attr-defined]
                if optimizer is not None
                else {}
            )
        return dict(model_state), dict(optim_state)

    # Units, for wrap's shard(), wrapping() and describe().

    def unit_options(self, options: dict[str, Any]) -> dict[str, Any]:
        from fsdp_guide.launcher import rank_device

        # FSDP1 must be told which device to run on: the rank's, by backend (the CPU under
        # gloo even where CUDA is there), as for the other engines.
        options.setdefault("device_id", rank_device())
        return options

    def shard(
        self, module: nn.Module, policy: UnitPolicy | None, options: dict[str, Any]
    ) -> nn.Module:
        auto_wrap_policy = policy.for_torch() if policy is not None else None
        return _fsdp1_class()(module, auto_wrap_policy=auto_wrap_policy, **options)

    def wrapping_context(self, options: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
        from torch.distributed.fsdp.wrap import enable_wrap

        return enable_wrap(wrapper_cls=_fsdp1_class(), **options)

    def wrap_unit(
        self, module: nn.Module, options: dict[str, Any], overrides: dict[str, Any]
    ) -> nn.Module:
        from torch.distributed.fsdp.wrap import wrap

        return wrap(module, **overrides)  # the block's options are enable_wrap's

    @classmethod
    def unit(cls, module: nn.Module) -> UnitView | None:
        if not isinstance(module, _fsdp1_class()):
            return None
        handle = getattr(module, "_handle", None)
        flat = handle.flat_param if handle is not None else None
        params = int(sum(flat._numels)) if flat is not None else 0
        return UnitView(inner=module.get_submodule("_fsdp_wrapped_module"), params=params)
