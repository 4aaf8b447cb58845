"""PyTorch ``DistributedDataParallel``: every rank holds everything (ZeRO stage 0).

DDP keeps the whole model, its gradients and the optimizer state on every rank and
all-reduces the gradients in buckets during backward (one all-reduce of ``Ψ`` per step). The
buckets are allocated when the model is wrapped, rebuilt once at the start of the second
forward (in the order the gradients became ready) and then kept for the whole run:
``zero_grad()`` does not free them. With ``gradient_as_bucket_view=True`` (this package's
setting) the gradients are views of those buckets, so the gradient bytes stay allocated
between steps; with torch's default ``False`` the buckets are a second copy of the gradients,
held between steps, while the gradients themselves come and go with each step.

Examples:
    >>> engine = DDP()
    >>> engine.stage_at_step, engine.collectives(1000, 4).payload
    (0, {'all_reduce': 1000})
    >>> engine.grads_between_steps, DDP(gradient_as_bucket_view=False).grads_between_steps
    (True, False)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from fsdp_guide.engines._base import Built, Engine, adam, replicated
from fsdp_guide.engines._records import Collectives, Layout, Transient
from fsdp_guide.engines._shape import ModelShape
from fsdp_guide.engines._step import StepPeak, StepSizes, highest

# Private: readers get an engine from fsdp_guide.engines.engine_for, not by its class.
__all__: list[str] = []

# DDP's default bucket_cap_mb: the largest gradient bucket all-reduced at once.
DDP_BUCKET_BYTES = 25 * 1024 * 1024
# DDP's first bucket is smaller, so that the first all-reduce starts early in backward.
FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True)
class DDP(Engine):
    """PyTorch ``DistributedDataParallel`` with torch's Adam.

    Attributes:
        gradient_as_bucket_view: DDP's setting of that name: ``True`` (the default here)
            makes the gradients views of the reducer's buckets, ``False`` (torch's default)
            keeps the buckets as a second copy of the gradients.
    """

    gradient_as_bucket_view: bool = True

    name = "ddp"
    title = "PyTorch DDP"
    syncs_every_microbatch = False  # no_sync() until the last micro-batch
    loads_dcp = True
    broadcasts_buffers = True

    @classmethod
    def recognises(cls, model: nn.Module, optimizer: object) -> bool:
        from torch.nn.parallel import DistributedDataParallel

        return isinstance(model, DistributedDataParallel)

    @classmethod
    def from_model(cls, model: nn.Module, optimizer: object) -> DDP:
        """The engine with the bucket setting ``model`` (a ``DistributedDataParallel``) has."""
        return cls(gradient_as_bucket_view=bool(getattr(model, "gradient_as_bucket_view", True)))

    def unwrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        return model.module if isinstance(model, DistributedDataParallel) else model

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """``DistributedDataParallel`` on ``device``, with this engine's bucket setting."""
        from torch.nn.parallel import DistributedDataParallel

        ids = [device] if device.type == "cuda" else None
        return DistributedDataParallel(
            model, device_ids=ids, gradient_as_bucket_view=self.gradient_as_bucket_view
        )

    def build(self, model: nn.Module, *, device: torch.device, world_size: int, lr: float) -> Built:
        module = self.wrap(model, device)
        return module, adam(module.parameters(), lr)

    @property
    def stage_at_step(self) -> int:
        return 0

    def layout(
        self, shapes: Sequence[Sequence[int]], world_size: int, *, fp32_adam: bool = True
    ) -> tuple[Layout, ...] | None:
        """Every tensor, its gradient and its optimizer state, on every rank, and the
        reducer's buckets where they are not the gradients.

        Examples:
            >>> DDP().layout([(10,), (7,)], 2)[1]
            Layout(params=17, grads=17, optimizer=17, steps=2, master=0, buckets=0, master_grads=0)
            >>> DDP(gradient_as_bucket_view=False).layout([(10,), (7,)], 2)[1].buckets
            17
        """
        total = sum(math.prod(shape) for shape in shapes)
        one = Layout(params=total, grads=total, optimizer=total, steps=len(shapes))
        return self.with_buckets(replicated(world_size, one), total)

    def with_buckets(self, layouts: tuple[Layout, ...], elements: int) -> tuple[Layout, ...]:
        """``layouts`` with DDP's buckets of ``elements`` on every rank where they are a
        second copy of the gradients (``gradient_as_bucket_view=False``).

        Examples:
            >>> one = (Layout(params=4, grads=4, optimizer=2, steps=1),)
            >>> DDP(gradient_as_bucket_view=False).with_buckets(one, 4)[0].buckets
            4
        """
        if self.gradient_as_bucket_view:
            return layouts
        return tuple(replace(layout, buckets=elements) for layout in layouts)

    @property
    def grads_between_steps(self) -> bool:
        """With ``gradient_as_bucket_view=True`` the gradients' storage is the reducer's
        buckets, which ``zero_grad()`` does not free."""
        return self.gradient_as_bucket_view

    @property
    def buckets_between_steps(self) -> bool:
        """The reducer keeps its buckets for the whole run."""
        return True

    def step_peak(self, sizes: StepSizes, world_size: int) -> StepPeak:
        """What a steady step adds to the state kept between steps (the buckets included).

        Forward: the activations it holds at most. Backward, with the gradients views of
        the buckets: each gradient lands in memory already held, once autograd's fresh
        gradient has been added to it, so backward holds its activations and one fresh
        gradient at most. With the buckets a second copy, the gradients come as backward
        goes, each freed only by ``zero_grad()``: in each stretch of backward, the
        activations, the gradients of the stretches before it and one of its own. The
        optimizer step reads every gradient (a second copy) and allocates its temporaries.
        Without a traced profile: every activation in backward, or every gradient from the
        end of backward through the optimizer step.

        Examples:
            >>> from fsdp_guide.engines import Stretch
            >>> sizes = StepSizes(params=400, grads=400, largest_unit=100,
            ...                   largest_unit_grads=100, root_unit=0, activations=50)
            >>> DDP().step_peak(sizes, 2).bytes
            50
            >>> DDP(gradient_as_bucket_view=False).step_peak(sizes, 2).phase
            'optimizer step'
            >>> traced = replace(sizes, stretches=(
            ...     Stretch(unit=False, start=50, peak=60, grads=100, largest_grad=100),
            ...     Stretch(unit=True, start=40, peak=70, grads=300, largest_grad=200)))
            >>> DDP().step_peak(traced, 2).bytes, DDP(False).step_peak(traced, 2).bytes
            (270, 370)
        """
        view = self.gradient_as_bucket_view
        forward = StepPeak(
            bytes=sizes.forward_peak, phase="forward", kind="activations and temporaries"
        )
        step = sizes.optimizer_step()
        if not sizes.stretches:
            if view or sizes.activations >= sizes.grads:
                backward = StepPeak(
                    bytes=sizes.activations,
                    phase="backward",
                    kind="activations (the gradients fill the kept buckets)"
                    if view
                    else "activations (the gradients replace them as backward goes)",
                )
            else:
                backward = StepPeak(
                    bytes=sizes.grads,
                    phase="optimizer step",
                    kind="every gradient, beside the buckets",
                )
            return highest(backward, step if sizes.step_grads or view else None)
        done, best = 0, 0
        for stretch in sizes.stretches:
            best = max(best, stretch.peak + (0 if view else done) + stretch.largest_grad)
            done += stretch.grads
        backward = StepPeak(
            bytes=best,
            phase="backward",
            kind="activations + a fresh gradient (added to its bucket)"
            if view
            else "activations + the gradients so far, beside the buckets",
        )
        return highest(forward, backward, step)

    def transient(
        self, *, param_bytes: int, grad_bytes: int, num_params: int, largest_unit: int
    ) -> Transient:
        """DDP copies gradients into buckets of at most 25 MiB to all-reduce them."""
        return Transient(
            bytes=min(DDP_BUCKET_BYTES, grad_bytes * num_params),
            kind="gradient bucket (DDP's 25 MiB cap)",
        )

    def collectives(
        self, num_params: int, world_size: int, root_unit_params: int = 0
    ) -> Collectives:
        return Collectives(payload={"all_reduce": num_params})

    def once_collectives(self, shape: ModelShape, world_size: int) -> Collectives:
        """DDP's collectives outside the steady step, elements by kind.

        When the model is wrapped: an all-gather of each rank's parameter count (one element
        a rank), then broadcasts from rank 0 of every parameter's sizes and strides (two
        elements a dimension) and of its parameters and buffers. At the start of the second
        forward, DDP regroups its buckets in the order the gradients arrived, and broadcasts
        the new layout: an index a parameter tensor, the bucket count, and each bucket's
        size (the first bucket closed at 1 MiB, the next ones at 25 MiB).

        Examples:
            >>> shape = ModelShape(units=(((4, 2), (4,), (3,)),), buffers=5)
            >>> dict(DDP().once_collectives(shape, 2).payload)  # 15 + 5 + 2 * 4, 3 + 1 + 1
            {'all_gather': 2, 'broadcast': 33}
            >>> DDP().once_collectives(shape, 1).payload  # no process group to sync
            {}
        """
        if world_size == 1:
            return Collectives(payload={})
        shapes = shape.shapes
        wrap = shape.num_params + shape.buffers + 2 * sum(len(s) for s in shapes)
        layout = len(shapes) + 1 + rebuilt_buckets(shapes)
        return Collectives(payload={"all_gather": world_size, "broadcast": wrap + layout})


def rebuilt_buckets(shapes: Sequence[Sequence[int]], element_size: int = 4) -> int:
    """How many gradient buckets DDP makes when it regroups them: the gradients in the order
    backward produces them (taken as the parameters' reverse order), a bucket closed once it
    holds 1 MiB (DDP's first bucket), the next ones at 25 MiB.

    Examples:
        >>> rebuilt_buckets([(1000,)] * 3), rebuilt_buckets([(300_000,)] * 3)
        (1, 2)
    """
    limits = [FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES]
    count, held = 0, 0
    for shape in reversed(shapes):
        held += math.prod(shape) * element_size
        if held >= limits[0]:
            count, held = count + 1, 0
            limits = limits[1:] or limits
    return count + (1 if held else 0)
