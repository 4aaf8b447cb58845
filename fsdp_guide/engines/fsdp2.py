"""PyTorch FSDP2 (``fully_shard``): each parameter a DTensor sharded by rows.

``fully_shard`` replaces each parameter by a ``DTensor`` sharded along its first dimension
over a device mesh: a parameter of ``r`` rows is cut into chunks of ``ceil(r / N)`` rows.
Parameters and gradients keep the padded chunk on every rank; Adam's moments only the rows a
rank really has (none on some ranks), and a step tensor per parameter. A unit is gathered for
its forward and again for its backward, except the root, kept gathered in between.

With ``shard_group`` set, the mesh has two dimensions, ``(replicate, shard)``: each
parameter is sharded within groups of ``shard_group`` ranks and replicated across the groups
(HSDP, hybrid sharding). A rank then holds a ``1 / shard_group`` share; after the
reduce-scatter within its group, each gradient shard is all-reduced across the replicas (FSDP2
issues that all-reduce even when there is one replica).

Examples:
    Rows of 10 and 7 on 2 ranks: chunks of 5 and 4 rows, so rank 1 has 5 + 3 elements.

    >>> [(s.params, s.optimizer) for s in FSDP2().layout([(10,), (7,)], 2)]
    [(9, 9), (9, 8)]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_guide.engines._base import Built, adam, fully_sharded
from fsdp_guide.engines._checkpoint import TorchStateDict, kept_fresh, without_state
from fsdp_guide.engines._records import Collectives, Layout, Transient
from fsdp_guide.engines._shape import ModelShape
from fsdp_guide.engines._step import StepPeak, StepSizes, highest
from fsdp_guide.engines._units import (
    UNIT_RULES,
    UnitEngine,
    UnitPolicy,
    UnitRule,
    UnitView,
    unit_modules,
    unit_names,
)

# Private: readers get an engine from fsdp_guide.engines.engine_for, not by its class.
__all__: list[str] = []


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's (FSDP2) local shard, else ``tensor``.

    Args:
        tensor: A plain tensor, a parameter or a ``DTensor``.

    Returns:
        The local tensor, whose storage is what this rank allocated.

    Examples:
        >>> weight = torch.ones(2, 3)
        >>> local_tensor(weight) is weight
        True
    """
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            return tensor.to_local()
    return tensor


def rows_per_shard(shapes: Sequence[Sequence[int]], group: int) -> tuple[int, list[int]]:
    """Padded elements per shard, and the elements each of the ``group`` shards really has.

    A parameter of ``r`` rows of ``w`` elements is cut into chunks of ``c = ceil(r / N)``
    rows: the first ``r // c`` shards get ``c`` rows, the next the remainder, the rest none.
    A difference array adds that up for all shards at once.

    Examples:
        >>> rows_per_shard([(3, 2)], 2)  # chunks of 2 rows: 4 elements, then 2
        (4, [4, 2])
    """
    padded = 0
    diff = [0] * (group + 1)
    for shape in shapes:
        rows = shape[0] if len(shape) else 1  # a 0-d parameter is one row of one
        width = math.prod(shape) // rows if rows else 0
        chunk = math.ceil(rows / group)
        padded += chunk * width
        if chunk == 0:
            continue
        full, rest = divmod(rows, chunk)
        diff[0] += chunk * width
        diff[full] -= chunk * width
        if rest:
            diff[full] += rest * width
            diff[full + 1] -= rest * width
    return padded, list(itertools.accumulate(diff[:group]))


def unsharded_grads(module: nn.Module) -> list[torch.Tensor]:
    """The unsharded gradients FSDP2 keeps while ``set_requires_gradient_sync(False)``
    holds back the reduce-scatter: in the reduce dtype when it differs from the
    parameters' (``unsharded_accumulated_grad``), else on the unsharded parameter."""
    fsdp_module = _fsdp_module()
    held: list[torch.Tensor] = []
    for sub in module.modules():
        if not isinstance(sub, fsdp_module):
            continue
        group = getattr(sub._get_fsdp_state(), "_fsdp_param_group", None)
        for param in getattr(group, "fsdp_params", ()):
            accumulated = getattr(param, "unsharded_accumulated_grad", None)
            unsharded = getattr(param, "_unsharded_param", None)
            for grad in (accumulated, getattr(unsharded, "grad", None)):
                if isinstance(grad, torch.Tensor):
                    held.append(grad)
    return held


def _fsdp_module() -> type[Any]:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


@dataclass(frozen=True, kw_only=True)
class FSDP2(TorchStateDict, UnitEngine):
    """PyTorch FSDP2 with Adam: ``fully_shard`` on each transformer block, then the root.

    Attributes:
        wrap: ``"blocks"``: a unit per transformer block
            (:func:`~fsdp_guide.engines.block_classes`); ``"root"``: the whole model one unit.
        shard_group: Ranks per shard group on a 2-D ``(replicate, shard)`` mesh (HSDP), when
            the world divides by it; ``None`` to shard over every rank (a 1-D mesh).
        reshard_after_forward: ``fully_shard``'s setting for the blocks: ``True`` frees each
            block's gathered parameters after its forward (gathered again for backward),
            ``False`` keeps them until backward, an int ``k`` keeps a ``1 / k`` shard of them
            (gathered again from ``k`` ranks for backward).
        forward_prefetch: How many of the next blocks each block gathers as its forward
            starts (``FSDPModule.set_modules_to_forward_prefetch``); ``0`` leaves FSDP2's
            own order: each block gathered as its forward starts.
        backward_prefetch: How many of the blocks backward reaches next each block gathers
            as its backward starts (``FSDPModule.set_modules_to_backward_prefetch``); ``0``
            leaves FSDP2's own: the next one.
        offload: ``fully_shard``'s ``offload_policy=CPUOffloadPolicy()``: the parameter and
            gradient shards in host memory, where the optimizer steps them; each block is
            copied to the accelerator to be gathered.

    Examples:
        >>> hsdp = FSDP2(shard_group=2)
        >>> hsdp.shard_group_size(4), hsdp.collectives(1000, 4, 100).payload
        (2, {'reduce_scatter': 1000, 'all_gather': 1900, 'all_reduce': 500})
    """

    name = "fsdp2"
    title = "PyTorch FSDP2 (fully_shard)"
    shards_in_place = True
    mixed_precision = "params"
    sharded_layout = "dcp"
    loads_dcp = True
    full_optimizer_keys = "name"

    shard_group: int | None = None
    wrap: UnitRule = "blocks"
    reshard_after_forward: bool | int = True
    forward_prefetch: int = 0
    backward_prefetch: int = 0
    offload: bool = False

    def __post_init__(self) -> None:
        if self.wrap not in UNIT_RULES:
            raise ValueError(f"unknown wrap {self.wrap!r}; choose one of {', '.join(UNIT_RULES)}")
        group = self.shard_group
        if group is not None and (
            isinstance(group, bool) or not isinstance(group, int) or group < 1
        ):
            raise ValueError(f"shard_group must be an int >= 1 or None, got {group!r}")
        for name in ("forward_prefetch", "backward_prefetch"):
            check_prefetch(name, getattr(self, name))

    @classmethod
    def recognises(cls, model: nn.Module, optimizer: object) -> bool:
        return isinstance(model, _fsdp_module())

    def shard_group_size(self, world_size: int) -> int:
        if self.shard_group is not None and world_size % self.shard_group == 0:
            return self.shard_group
        return world_size

    def mesh(self, device: torch.device, world_size: int) -> Any:
        """The device mesh the parameters are sharded over: every rank, or ``(replicate, shard)``.

        Row-major: rank ``r`` is in shard group ``r // shard_group`` at position
        ``r % shard_group``, so the ranks of a group are neighbours (on one machine, say).
        """
        from torch.distributed.device_mesh import init_device_mesh

        if self.shard_group is None:
            return init_device_mesh(device.type, (world_size,))
        shard = self.shard_group_size(world_size)
        return init_device_mesh(
            device.type, (world_size // shard, shard), mesh_dim_names=("replicate", "shard")
        )

    def build(self, model: nn.Module, *, device: torch.device, world_size: int, lr: float) -> Built:
        from torch.distributed.fsdp import fully_shard

        mesh = self.mesh(device, world_size)
        options: dict[str, Any] = {"mesh": mesh}
        if self.offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            # Pinned host memory needs an accelerator; on a CPU run the shards are host memory.
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type != "cpu")
        blocks = [model.get_submodule(name) for name in unit_names(model, self.wrap)]
        for block in blocks:  # children before parents
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **options)
        fully_shard(model, **options)
        set_prefetch(blocks, forward=self.forward_prefetch, backward=self.backward_prefetch)
        return model, adam(model.parameters(), lr)

    @property
    def stage_at_step(self) -> int:
        return 3

    def layout(
        self, shapes: Sequence[Sequence[int]], world_size: int, *, fp32_adam: bool = True
    ) -> tuple[Layout, ...]:
        group = self.shard_group_size(world_size)
        padded, local = rows_per_shard(shapes, group)
        by_shard = [
            Layout(params=padded, grads=padded, optimizer=elements, steps=len(shapes))
            for elements in local
        ]
        # The rank's coordinate in its shard group (the mesh is row-major).
        return tuple(by_shard[rank % group] for rank in range(world_size))

    def host_layout(self, layout: Layout) -> Layout:
        """With ``offload``, the whole state: shards, their gradients and Adam's state."""
        return layout if self.offload else super().host_layout(layout)

    @property
    def steps_on_host(self) -> bool:
        return self.offload

    def transient(
        self, *, param_bytes: int, grad_bytes: int, num_params: int, largest_unit: int
    ) -> Transient:
        return Transient(
            bytes=(param_bytes + grad_bytes) * largest_unit,
            kind="largest gathered unit (params + grads)",
        )

    def stepped_tensors(self, shape: ModelShape, world_size: int) -> list[int]:
        """Each parameter's row chunk.

        Examples:
            >>> FSDP2().stepped_tensors(ModelShape(units=(((3,),), ((5, 2),))), 2)
            [2, 6]
        """
        group = self.shard_group_size(world_size)
        return [rows_per_shard([s], group)[0] for s in shape.shapes]

    def step_peak(self, sizes: StepSizes, world_size: int) -> StepPeak:
        """The most a step holds beyond the state kept between steps, moment by moment.

        With the activations traced over the step (:attr:`StepSizes.forward` and
        :attr:`StepSizes.stretches`), the largest of:

        * forward: in a block, its activations, the root, the blocks gathered so far (the
          running one, those prefetched, and every earlier one without resharding) and the
          all-gather's result FSDP2 holds until the next copy-out (on more than one rank);
          elsewhere (the loss), the root, the blocks kept gathered and that result;
        * the loss's backward: the root, and at each moment its activations and the
          gradients made so far (the head's weight gradient comes after its logits');
        * each block's backward: its activations (a checkpointed block's forward run
          again), the root, the blocks gathered (itself and up to ``backward_prefetch`` of
          those still to come; every block not yet done without resharding), the sharded
          gradients of the blocks done (at one rank a shard is the whole tensor: they pile
          up to every gradient) and the loss's gradients; for the last block, its
          unsharded gradients as they replace its activations; for the others, the
          previous block's reduce-scatter input, which FSDP2 keeps until the next
          reduce-scatter, and the all-gather result it holds;
        * the optimizer step: the sharded gradients and the optimizer's temporaries.

        Without a traced profile, the moments of :meth:`_untraced_peak`.

        Examples:
            >>> from fsdp_guide.engines import Stretch
            >>> def stretch(unit: bool, start: int, peak: int, grads: int = 0) -> Stretch:
            ...     return Stretch(unit=unit, start=start, peak=peak, grads=grads,
            ...                    largest_grad=grads)
            >>> sizes = StepSizes(params=1000, grads=1000, largest_unit=200,
            ...                   largest_unit_grads=200, root_unit=200, activations=300,
            ...                   blocks=4, forward=(stretch(True, 0, 150),),
            ...                   stretches=(stretch(False, 300, 320), stretch(True, 280, 300,
            ...                   200), stretch(True, 210, 230, 200)))
            >>> peak = FSDP2().step_peak(sizes, 2)
            >>> peak.bytes, peak.phase  # 230 + 200 + 200 + root + itself (none left) + 100
            (1130, 'backward')
            >>> FSDP2().step_peak(sizes, 1).bytes  # 230 + 200 + 200 + root + a block + 200
            1230
        """
        if not sizes.stretches:
            return self._untraced_peak(sizes, world_size)
        unit, grads, root = sizes.largest_unit, sizes.largest_unit_grads, sizes.root_unit
        ahead = 0 if world_size == 1 else max(self.backward_prefetch, 1)
        resharded = self.reshard_after_forward is not False
        kept = share = 0  # with reshard_after_forward=k, the blocks' 1 / k shares kept
        if resharded and self.reshard_after_forward is not True:
            others = sizes.params - root - (1 + ahead) * unit
            kept = max(others, 0) // int(self.reshard_after_forward)
            share = unit // int(self.reshard_after_forward)
        shard = grads if world_size == 1 else grads // world_size
        if self.offload:  # the sharded gradients go to host memory
            shard = 0
        head = sizes.head_grads
        forward = StepPeak(bytes=0, phase="forward", kind="")
        done = 0
        result = 0 if world_size == 1 else unit  # the all-gather result held to the next
        blocks = sum(s.unit for s in sizes.forward)
        for stretch in sizes.forward:
            if not stretch.unit:
                before = root + done * share if resharded else root + done * unit
                held = stretch.peak + before + (result if done else 0)
            elif resharded:
                prefetched = min(self.forward_prefetch, blocks - 1 - done)
                held = stretch.peak + root + (1 + prefetched) * unit + result + done * share
            else:
                held = stretch.peak + root + (done + 1) * unit + result
            done += stretch.unit
            if held > forward.bytes:
                forward = StepPeak(
                    bytes=held,
                    phase="forward",
                    kind="activations + root + the blocks gathered + an all-gather result"
                    if stretch.unit
                    else "activations + the parameters gathered",
                )
        units = sizes.units_backward
        best = StepPeak(bytes=0, phase="backward", kind="")
        for j, stretch in enumerate(units):
            if resharded:
                gathered = root + kept + (1 + min(ahead, len(units) - 1 - j)) * unit
            else:
                gathered = sizes.params - j * unit
            if j == 0:  # its gradients replace its activations as its backward goes
                own = max(stretch.peak, stretch.start + grads)
            else:
                own = stretch.peak + grads + (unit if resharded else 0)
            held = own + gathered + j * shard + head
            if held > best.bytes:
                best = StepPeak(
                    bytes=held,
                    phase="backward",
                    kind="a block's backward: activations + root + the blocks gathered + "
                    "gradients in the reduce-scatter + the shards done",
                )
        loss = StepPeak(
            bytes=sizes.head_held + (root if resharded else sizes.params),
            phase="backward",
            kind="the loss's backward: activations + root + the gradients made so far",
        )
        return highest(
            forward_prefetch_peak(sizes, self.forward_prefetch, self.reshard_after_forward),
            forward,
            loss,
            best,
            sizes.optimizer_step(),
        )

    def _untraced_peak(self, sizes: StepSizes, world_size: int) -> StepPeak:
        """The peak of a step from the saved activations alone (no traced profile): where
        ``reshard_after_forward`` and the prefetch counts put it.

        ``True``: in backward, the root's parameters (kept from forward), the running block
        gathered, the blocks gathered ahead of it (one by default; ``backward_prefetch`` of
        them when it is more, as far as there are blocks before it), and the larger of two
        moments. In the last block's backward, every activation and that block's unsharded
        gradients. As the next block's backward starts (the peak torch's profiler measures
        on this package's models): the last block's share of the activations (an equal share
        per block) is freed, but its gradients are held in the reduce-scatter's input and,
        a ``1 / N`` share, in its output; the prefetched block's all-gather output is
        allocated, and one more block-sized all-gather buffer with it (on ``gloo``, the
        backend's own staging copy). ``False``: at the end of forward, every activation and
        every parameter gathered, plus the copy-out buffer of the last all-gather (a block).
        An int ``k``: as ``True``, plus the ``1 / k`` share each other block keeps from
        forward (the gathered blocks were gathered from theirs, which are freed).

        ``forward_prefetch`` holds its blocks' all-gather buffers in forward, beside the
        running block and its copy-out buffer, while only the activations saved so far are
        held (taken as an equal share per block): it moves the peak into forward only where
        those buffers outweigh the activations the later blocks save, as with small batches.

        Examples:
            >>> sizes = StepSizes(params=1000, grads=1000, largest_unit=200,
            ...                   largest_unit_grads=200, root_unit=200, activations=1000,
            ...                   blocks=4)
            >>> [FSDP2(reshard_after_forward=r).step_peak(sizes, 4).bytes for r in (True, False, 2)]
            [1800, 2200, 2000]
            >>> [FSDP2(backward_prefetch=b).step_peak(sizes, 4).bytes for b in (1, 2, 3, 9)]
            [1800, 2000, 2200, 2200]
            >>> from dataclasses import replace
            >>> few = replace(sizes, activations=100)  # 25 a block, under its 200 of parameters
            >>> FSDP2().step_peak(few, 4).bytes  # 75 + the root, 2 blocks, 2 buffers, 200 / 4
            1125
            >>> [(p.bytes, p.phase) for p in (FSDP2(forward_prefetch=f).step_peak(few, 4)
            ...                                for f in (0, 3))]
            [(1125, 'backward'), (1225, 'forward')]
        """
        a, unit = sizes.activations, sizes.largest_unit
        if self.reshard_after_forward is False:
            return StepPeak(
                bytes=a + sizes.params + unit,
                phase="forward",
                kind="activations + every parameter gathered + one all-gather buffer",
            )
        ahead = max(self.backward_prefetch, 1)  # FSDP2's own: the next block
        if sizes.blocks is not None and sizes.blocks > 1:
            ahead = min(ahead, sizes.blocks - 1)
        gathered = 1 + ahead
        kept = 0
        if self.reshard_after_forward is not True:
            others = sizes.params - sizes.root_unit - gathered * unit
            kept = max(others, 0) // int(self.reshard_after_forward)
        words = "two gathered blocks" if gathered == 2 else f"{gathered} gathered blocks"
        kept_words = " + the other blocks' shares kept from forward" if kept else ""
        held = sizes.root_unit + kept + gathered * unit  # at either moment
        grads = sizes.largest_unit_grads
        backward = StepPeak(
            bytes=a + held + grads,
            phase="backward",
            kind=f"activations + root + {words} + a block's gradients" + kept_words,
        )
        if sizes.blocks is not None and sizes.blocks > 1:
            # One block later: the last block's activations freed, its gradients in the
            # reduce-scatter's input and output, an all-gather buffer beside the gathered.
            later = a - a // sizes.blocks + held + unit + grads + grads // max(world_size, 1)
            if later > backward.bytes:
                backward = StepPeak(
                    bytes=later,
                    phase="backward",
                    kind=f"activations but the last block's + root + {words} + an all-gather"
                    " buffer + the last block's gradients in the reduce-scatter" + kept_words,
                )
        forward = forward_prefetch_peak(sizes, self.forward_prefetch, self.reshard_after_forward)
        return forward if forward is not None and forward.bytes > backward.bytes else backward

    def collectives(
        self, num_params: int, world_size: int, root_unit_params: int = 0
    ) -> Collectives:
        """ZeRO-3's within a shard group; with HSDP, each gradient shard all-reduced across
        the replicas (exact when each parameter's rows divide by the group: else padded)."""
        shard = self.shard_group_size(world_size)
        sharded = fully_sharded(num_params, shard, root_unit_params)
        if self.reshard_after_forward is False:  # kept gathered: backward gathers nothing
            sharded = Collectives(
                payload={**sharded.payload, "all_gather": num_params}, groups=sharded.groups
            )
        if self.shard_group is None:
            return sharded
        return Collectives(
            payload={**sharded.payload, "all_reduce": math.ceil(num_params / shard)},
            groups={**sharded.groups, "all_reduce": world_size // shard},
        )

    def step_collectives(self, shape: ModelShape, world_size: int) -> Collectives:
        """Each parameter padded to whole row chunks of the shard group.

        Examples:
            >>> shape = ModelShape(units=(((3,),), ((5, 2),)))  # 3 rows, then 5 rows of 2
            >>> FSDP2().step_collectives(shape, 2).payload  # padded to 4 elements and 6 rows of 2
            {'reduce_scatter': 16, 'all_gather': 28}
        """
        group = self.shard_group_size(world_size)
        padded = [rows_per_shard(unit, group)[0] * group for unit in shape.units]
        issued = self.collectives(sum(padded), world_size, padded[0] if padded else 0)
        if self.shard_group is None:
            return issued
        payload = {**issued.payload, "all_reduce": sum(padded) // group}
        return Collectives(payload=payload, groups=issued.groups)

    def root_unit_params(self, module: nn.Module) -> int:
        fsdp_module = _fsdp_module()
        if not isinstance(module, fsdp_module):
            return 0
        nested = {
            id(p)
            for name, sub in module.named_modules()
            if name and isinstance(sub, fsdp_module)
            for p in module.get_submodule(name).parameters()
        }
        return sum(p.numel() for p in module.parameters() if id(p) not in nested)

    def held_grads(self, module: nn.Module) -> list[torch.Tensor]:
        return unsharded_grads(module)

    def gather_to_rank0(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Gathered into rank 0 only, one tensor at a time (DCP's rank-0-only mode)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # cpu_offload=True with full_state_dict=True is DCP's rank-0-only mode (CPU too).
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        with kept_fresh(optimizer) as fresh:
            model_state, optim_state = get_state_dict(
                model, [optimizer] if optimizer is not None else [], options=options
            )
        return dict(model_state), without_state(dict(optim_state)) if fresh else dict(optim_state)

    # Units, for wrap's shard(), wrapping() and describe().

    def unit_options(self, options: dict[str, Any]) -> dict[str, Any]:
        if options.get("mesh") is None:
            import torch.distributed as dist

            from fsdp_guide.launcher import rank_device

            options["mesh"] = self.mesh(rank_device(), dist.get_world_size())
        return options

    def shard(
        self, module: nn.Module, policy: UnitPolicy | None, options: dict[str, Any]
    ) -> nn.Module:
        """``fully_shard`` on each unit, then the root; ``forward_prefetch`` and
        ``backward_prefetch`` among ``options`` are the counts of :class:`FSDP2`'s settings,
        applied to the units once every one is sharded."""
        from torch.distributed.fsdp import fully_shard

        options = dict(options)
        # Checked before anything is sharded, so a bad count leaves the model as it was.
        forward = options.pop("forward_prefetch", self.forward_prefetch)
        backward = options.pop("backward_prefetch", self.backward_prefetch)
        forward = check_prefetch("forward_prefetch", forward)
        backward = check_prefetch("backward_prefetch", backward)
        names = policy.select(module) if policy is not None else []
        units = [unit_modules(module, name) for name in names]
        for unit in units:  # children before parents, as fully_shard requires
            fully_shard(unit if len(unit) > 1 else unit[0], **options)
        fully_shard(module, **options)
        set_prefetch([u[0] for u in units], forward=forward, backward=backward)
        return module

    def wrap_unit(
        self, module: nn.Module, options: dict[str, Any], overrides: dict[str, Any]
    ) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        fully_shard(module, **{**options, **overrides})
        return module

    @classmethod
    def unit(cls, module: nn.Module) -> UnitView | None:
        return UnitView(inner=module, params=None) if cls.recognises(module, None) else None


# FSDP2's explicit prefetch: which blocks each block gathers ahead, and what that holds.


def check_prefetch(name: str, value: object) -> int:
    """``value`` as a prefetch count, or a ``ValueError`` that says what to give instead."""
    # A bool is an int to Python, but True here is FSDP1's switch, not a count of blocks.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        fsdp1 = "forward_prefetch=True" if name == "forward_prefetch" else "'BACKWARD_PRE'"
        raise ValueError(
            f"FSDP2's {name} is how many blocks each block gathers ahead: give an int >= 0 "
            f"(0 keeps FSDP2's own order; FSDP1's {fsdp1} is 1), got {value!r}"
        )
    return value


def set_prefetch(blocks: Sequence[nn.Module], *, forward: int = 0, backward: int = 0) -> None:
    """Have each of ``blocks`` (units, in forward order) gather ``forward`` next blocks as its
    forward starts and ``backward`` previous ones as its backward starts.

    A count of ``0`` leaves that pass to FSDP2's own order (each block gathered as it
    starts, and in backward the next one ahead). The last blocks prefetch what is left.

    Raises:
        ValueError: A count that is not an int >= 0.

    Examples:
        >>> set_prefetch([], forward=-1)
        Traceback (most recent call last):
        ...
        ValueError: FSDP2's forward_prefetch is how many blocks each block gathers ahead: ...
    """
    forward = check_prefetch("forward_prefetch", forward)
    backward = check_prefetch("backward_prefetch", backward)
    units: list[Any] = list(blocks)
    for index, block in enumerate(units):
        if forward:
            block.set_modules_to_forward_prefetch(units[index + 1 : index + 1 + forward])
        if backward and index:  # the first block has none before it: FSDP2's own is the same
            # Nearest first: backward reaches block index - 1, then index - 2, ...
            block.set_modules_to_backward_prefetch(units[max(index - backward, 0) : index][::-1])


def forward_prefetch_peak(
    sizes: StepSizes, forward_prefetch: int, reshard_after_forward: bool | int
) -> StepPeak | None:
    """The most held in forward with ``forward_prefetch``: at block ``i`` of ``n``, the
    activations of blocks ``0..i``, the root, block ``i`` and its copy-out buffer, and the
    buffers of the blocks after it that it prefetched; ``None`` without forward prefetch."""
    n = sizes.blocks
    if not forward_prefetch or not n:
        return None
    # Resharded to a 1 / k share, the blocks done so far keep theirs until backward.
    share = 0 if reshard_after_forward is True else int(reshard_after_forward)
    best = (0, 0)
    for index in range(n):
        ahead = min(forward_prefetch, n - 1 - index)
        held = sizes.activations * (index + 1) // n + (2 + ahead) * sizes.largest_unit
        held += index * sizes.largest_unit // share if share else 0
        best = max(best, (held, ahead))
    held, ahead = best
    return StepPeak(
        bytes=held + sizes.root_unit,
        phase="forward",
        kind="activations so far + root + a block gathered + its all-gather buffer"
        + f" + {ahead} prefetched",
    )
