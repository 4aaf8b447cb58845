"""What every engine adapter answers: the :class:`Engine` base class (private).

An *engine* is the implementation that shards (or replicates) a model across ranks: PyTorch
DDP, ``ZeroRedundancyOptimizer``, FairScale OSS and ShardedDDP, PyTorch FSDP1 and FSDP2,
FairScale FSDP, DeepSpeed ZeRO. A catalog row (a *strategy*) names an engine and its
settings; the adapter, built from those settings, is the one place that knows how the
engine wraps a model, what each rank holds and what it sends per step. The rest of the
package asks it instead of branching on names.

Its answers are the records of ``_records.py``, counted in elements, not bytes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from fsdp_guide.engines._records import Collectives, Layout, Transient
from fsdp_guide.engines._shape import ModelShape
from fsdp_guide.engines._step import Gathered, StepPeak, StepSizes, highest

#: What :meth:`Engine.build` returns: the module to train and its optimizer. A DeepSpeed
#: engine's optimizer is DeepSpeed's ZeRO optimizer, typed as the torch optimizer it wraps.
Built = tuple[nn.Module, torch.optim.Optimizer]


@dataclass(frozen=True)
class Engine(ABC):
    """One implementation that trains a model on many ranks, configured by a strategy's settings.

    A subclass is a frozen dataclass whose fields are the settings a catalog row may give
    (``FSDP1(sharding_strategy="SHARD_GRAD_OP")``); :func:`fsdp_guide.engines.engine_for`
    builds it from a row. It answers for its engine, and only for it:

    * **build**: wrap a model and build its Adam optimizer inside a launched rank;
    * **recognise**: whether a trained model and optimizer are its own;
    * **memory**: the ZeRO stage that describes the state after ``optimizer.step()``, the
      ranks it shards over, each rank's :class:`Layout` (to the element), the largest
      ``Transient`` buffer;
    * **communication**: the :class:`Collectives` of one step;
    * **training**: one backward and optimizer step, and clearing the gradients.

    * **checkpoints**: its full state and how it loads one, its sharded state and the
      layout :func:`fsdp_guide.checkpoint.save` writes it in.

    FSDP units are answered by the same adapters, through :class:`~fsdp_guide.engines.UnitEngine`.
    """

    #: The engine's name, as the rows of :data:`~fsdp_guide.catalog.STRATEGIES` give it.
    name: ClassVar[str]
    #: What it is, in a few words.
    title: ClassVar[str]
    #: Older spellings of :attr:`name` still accepted.
    aliases: ClassVar[tuple[str, ...]] = ()
    #: 0 for an engine its maintainers develop (DDP, ZeroRedundancyOptimizer, FSDP2,
    #: DeepSpeed), 1 for a superseded one (FSDP1, by FSDP2; its ``NO_SHARD`` already warns
    #: it is deprecated), 2 for one no longer developed (FairScale's last release was in
    #: 2022); the planner's recommendation ranks plans by it first.
    maintenance: ClassVar[int] = 0
    #: Whether its optimizer steps ``FlatParameter`` objects (FSDP1, FairScale FSDP): torch's
    #: optimizers take their foreach path for plain tensors, parameters and DTensors only.
    flat_parameters: ClassVar[bool] = False
    #: Tensors hung on a parameter that hold its data (shards, gathered copies).
    param_buffers: ClassVar[tuple[str, ...]] = ()
    #: Tensors hung on a parameter that hold a gradient shard.
    grad_buffers: ClassVar[tuple[str, ...]] = ()
    #: How ``kind="sharded"`` stores its shards: ``"dcp"`` (``torch.distributed.checkpoint``,
    #: loads at any world size), ``"rank_files"`` (a file per rank, same world size),
    #: ``"deepspeed"`` (DeepSpeed's own files); ``None`` when it shards no parameters.
    sharded_layout: ClassVar[str | None] = None
    #: Whether it saves ``kind="full"`` (a DeepSpeed engine saves its own files only).
    saves_full: ClassVar[bool] = True
    #: Whether a DCP checkpoint loads into it (what ``set_state_dict`` fills).
    loads_dcp: ClassVar[bool] = False
    #: How :meth:`~fsdp_guide.engines.Engine.full_state` keys the optimizer state:
    #: ``"position"`` (the optimizer's ``state_dict()``, turned into names by the
    #: checkpoint), ``"name"`` (by parameter name already), ``"own"`` (the engine's own
    #: gathered form, which loads only into it).
    full_optimizer_keys: ClassVar[str] = "position"
    #: Whether it broadcasts the model's buffers from rank 0 before each forward (DDP's
    #: ``broadcast_buffers=True``, which every DDP-based engine here keeps).
    broadcasts_buffers: ClassVar[bool] = False
    #: ``"autocast"`` or ``"params"``, how it runs bf16 mixed precision. ``"autocast"`` (DDP
    #: and the optimizers over it): ``torch.autocast`` keeps bf16 copies of the weights for
    #: backward; ``"params"`` (FSDP's ``MixedPrecision``, FSDP2's ``MixedPrecisionPolicy``,
    #: DeepSpeed's ``bf16``): the parameters themselves are cast, the forward's inputs too.
    mixed_precision: ClassVar[str] = "autocast"
    #: Whether each micro-batch of gradient accumulation issues the step's collectives
    #: (FSDP and DeepSpeed ZeRO-2/3 reduce every micro-batch's gradients); ``False`` where
    #: the gradients are reduced once per optimizer step (DDP under ``no_sync()``).
    syncs_every_microbatch: ClassVar[bool] = True
    #: ``True`` where bf16 mixed precision keeps the state in fp32 and computes on bf16
    #: copies, as torch's autocast, FSDP's ``MixedPrecision``, FSDP2's
    #: ``MixedPrecisionPolicy`` and FairScale do; ``False`` for DeepSpeed, whose bf16
    #: parameters and gradients sit beside an fp32 master copy (:meth:`mixed_layout`).
    fp32_state_when_mixed: ClassVar[bool] = True

    @classmethod
    @abstractmethod
    def recognises(cls, model: nn.Module, optimizer: object) -> bool:
        """Whether ``model`` and ``optimizer`` were built by this engine."""

    @classmethod
    def from_model(cls, model: nn.Module, optimizer: object) -> Engine:
        """This engine as it built ``model`` (which it :meth:`recognises`): its settings where
        the objects tell them, else the defaults."""
        return cls()

    @abstractmethod
    def build(self, model: nn.Module, *, device: torch.device, world_size: int, lr: float) -> Built:
        """Wrap ``model`` (already on ``device``) and build its Adam optimizer, in a launched rank.

        Args:
            model: The model, identical on every rank.
            device: This rank's device.
            world_size: Number of ranks.
            lr: Adam's learning rate.
        """

    @property
    @abstractmethod
    def stage_at_step(self) -> int:
        """The ZeRO stage whose formula describes the state held after ``optimizer.step()``."""

    @property
    def full_grads(self) -> bool:
        """Whether every rank keeps a full-size gradient buffer whatever the stage."""
        return False

    def shard_group_size(self, world_size: int) -> int:
        """Ranks the state is sharded over (all of them, unless the engine shards in groups)."""
        return world_size

    @abstractmethod
    def layout(
        self, shapes: Sequence[Sequence[int]], world_size: int, *, fp32_adam: bool = True
    ) -> tuple[Layout, ...] | None:
        """What each rank holds after ``optimizer.step()``, ``[r]`` for rank ``r``.

        Args:
            shapes: The shape of each parameter, in ``model.parameters()`` order.
            world_size: Ranks.
            fp32_adam: Whether the model trains in fp32 with Adam, the setting every layout
                was measured in; an engine whose layout depends on it returns ``None``
                otherwise.

        Returns:
            One :class:`Layout` per rank, or ``None`` where the layout is not known (the
            caller falls back to the ZeRO formula).
        """

    def shape_layout(
        self, shape: ModelShape, world_size: int, *, fp32_adam: bool = True
    ) -> tuple[Layout, ...] | None:
        """:meth:`layout` of a model cut into units (an engine whose layout depends on its
        units, FSDP1's flat parameter per unit, reads them)."""
        return self.layout(shape.shapes, world_size, fp32_adam=fp32_adam)

    def mixed_layout(
        self, shapes: Sequence[Sequence[int]], world_size: int
    ) -> tuple[Layout, ...] | None:
        """What each rank holds after the step when training in bf16 with Adam, or ``None``.

        A layout here counts the fp32 master copy in :attr:`Layout.master` (and its gradient
        in :attr:`Layout.master_grads`), so the optimizer's elements carry Adam's moments
        only. ``None`` (the default): not known, the caller falls back to the ZeRO formula.
        """
        return None

    def own_formula(self, param_numels: Sequence[int], world_size: int) -> Layout | None:
        """The engine's own formula where the ZeRO formula's layout does not apply, else None.

        DeepSpeed keeps a separate master copy and pads its partitions, so its state after
        the step is not the ZeRO formula's; every other engine is (up to rounding).
        """
        return None

    @abstractmethod
    def transient(
        self, *, param_bytes: int, grad_bytes: int, num_params: int, largest_unit: int
    ) -> Transient:
        """The largest short-lived buffer of a step, beyond this rank's share of the state.

        Args:
            param_bytes: Bytes per parameter element.
            grad_bytes: Bytes per gradient element.
            num_params: Parameters of the model.
            largest_unit: Parameters of the largest unit (a transformer block, say).
        """

    @property
    def grads_between_steps(self) -> bool:
        """Whether the gradient buffers of :meth:`layout` stay allocated between steps
        (DeepSpeed ZeRO-3's partition buffer and reduce bucket); ``False`` where
        ``zero_grad()`` frees them."""
        return False

    @property
    def buckets_between_steps(self) -> bool:
        """Whether the buckets of :meth:`layout` stay allocated between steps (DDP's, for the
        whole run); by default as the gradients do."""
        return self.grads_between_steps

    def host_layout(self, layout: Layout) -> Layout:
        """The part of a rank's :meth:`layout` kept in host memory (offloaded), in elements:
        nothing, unless the engine offloads.

        Examples:
            >>> from fsdp_guide.engines import DDP
            >>> DDP().host_layout(Layout(params=4, grads=4, optimizer=4, steps=1)).params
            0
        """
        return Layout(params=0, grads=0, optimizer=0, steps=0)

    @property
    def steps_on_host(self) -> bool:
        """Whether the optimizer steps in host memory, as an offloaded optimizer does.

        Its step then holds nothing more on the accelerator.
        """
        return False

    @property
    def step_gradient_fields(self) -> tuple[str, ...]:
        """The fields of a rank's model state (``"grads"``, ``"master"``, ...) whose size
        the optimizer step holds as gradients beyond the state kept between steps: the
        gradients, unless they stay allocated between steps."""
        return () if self.grads_between_steps else ("grads",)

    def gathered(self, sizes: StepSizes, world_size: int) -> Gathered | None:
        """Whole parameters the engine keeps beyond its shards, where its planner reports
        them apart from :meth:`transient` (DeepSpeed ZeRO-3); ``None`` for the others,
        whose transient buffer says it all.

        Args:
            sizes: The sizes of the model, its activations and its modules' order.
            world_size: Ranks.
        """
        return None

    def step_peak(self, sizes: StepSizes, world_size: int) -> StepPeak:
        """The peak of a steady training step, beyond the state kept between steps.

        The default, an upper bound: the most activations backward holds while it has
        written every gradient; or the optimizer step, if that holds more.

        Args:
            sizes: The sizes of the model and its activations.
            world_size: Ranks.

        Examples:
            >>> from fsdp_guide.engines import Plain
            >>> sizes = StepSizes(params=400, grads=400, largest_unit=100,
            ...                   largest_unit_grads=100, root_unit=0, activations=50)
            >>> Plain().step_peak(sizes, 2).bytes
            450
        """
        backward = StepPeak(
            bytes=sizes.backward_activations + sizes.grads,
            phase="backward",
            kind="activations + every gradient",
        )
        return highest(backward, sizes.optimizer_step())

    def stepped_tensors(self, shape: ModelShape, world_size: int) -> list[int]:
        """Elements of each tensor this engine's optimizer steps on a rank, in its order
        (the parameters, unless the engine flattens or shards them)."""
        return [math.prod(s) for s in shape.shapes]

    @abstractmethod
    def collectives(
        self, num_params: int, world_size: int, root_unit_params: int = 0
    ) -> Collectives:
        """What one rank issues in one training step.

        Args:
            num_params: Parameters of the model (``Ψ``).
            world_size: Ranks.
            root_unit_params: Parameters of a fully sharded model's root unit, which is
                gathered once per step, not twice (ignored by the other engines).
        """

    def once_collectives(self, shape: ModelShape, world_size: int) -> Collectives:
        """What one rank issues once, outside the steady step (when the model is wrapped,
        or while the engine settles in its first steps): nothing, unless an engine says so."""
        return Collectives(payload={})

    def step_collectives(self, shape: ModelShape, world_size: int) -> Collectives:
        """What one rank issues in one training step of a model of this ``shape``.

        :meth:`collectives` of its ``Ψ`` and root unit, plus the broadcast of the buffers
        for an engine that :attr:`broadcasts_buffers` (on more than one rank); an engine
        that pads (FSDP's flat parameters and row chunks, DeepSpeed's partitions) counts
        the padding here.
        """
        issued = self.collectives(shape.num_params, world_size, shape.root_params)
        if not (self.broadcasts_buffers and shape.buffers and world_size > 1):
            return issued
        payload = dict(issued.payload)
        payload["broadcast"] = payload.get("broadcast", 0) + shape.buffers
        return Collectives(payload=payload, groups=issued.groups)

    def root_unit_params(self, module: nn.Module) -> int:
        """Parameters of the root unit of a module this engine wrapped; 0 without units."""
        return 0

    def optimizer_of(self, module: nn.Module, optimizer: object) -> Any:
        """The optimizer whose state ``module``'s rank holds: ``optimizer``, unless the engine
        owns one (a DeepSpeed engine's, whichever of its names was given).

        Raises:
            ValueError: For an optimizer the engine does not use.
        """
        return optimizer

    def held_grads(self, module: nn.Module) -> list[torch.Tensor]:
        """Gradients a rank holds that no parameter's ``.grad`` shows: FSDP2's unsharded
        gradients, kept between the micro-steps of gradient accumulation while gradient sync
        is off; none for the other engines."""
        return []

    def state_tensors(self, module: nn.Module, optimizer: object) -> dict[str, list[Any]] | None:
        """The tensors a rank holds by ``ModelState`` field, where
        the generic walk over parameters, gradients and optimizer state would miss them
        (DeepSpeed's flat partitions); ``None`` for the generic walk."""
        return None

    # Checkpoints: the defaults are for engines that keep the whole model on every rank.

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the engine's wrapper (DDP's ``model.module``)."""
        return model

    def expected_state(self, model: nn.Module) -> dict[str, Any]:
        """The model's state dict as a load expects it, without gathering anything: the names,
        and values whose whole shapes the saved tensors must have."""
        return dict(self.unwrap(model).state_dict())

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The model's full state and the optimizer's, keyed as ``full_optimizer_keys`` says
        (collective: every rank calls it); ``(None, None)`` on ranks that do not keep it."""
        model_state = dict(self.unwrap(model).state_dict())
        return model_state, (optimizer.state_dict() if optimizer is not None else None)

    def load_full_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        model_state: dict[str, Any],
        optim_state: dict[str, Any] | None,
    ) -> None:
        """Load a full state (the optimizer's keyed as :meth:`full_state` keys it), every rank."""
        self.unwrap(model).load_state_dict(model_state)
        if optimizer is not None and optim_state is not None:
            optimizer.load_state_dict(optim_state)

    def sharded_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> dict[str, Any]:
        """This rank's shards, for the ``"dcp"`` and ``"rank_files"`` layouts (collective).

        Raises:
            ValueError: For an engine that shards no parameters.
        """
        raise ValueError(f"{type(self).__name__} has no sharded state")

    def load_rank_file(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, shard: dict[str, Any]
    ) -> None:
        """Load this rank's file of the ``"rank_files"`` layout."""
        raise ValueError(f"{type(self).__name__} writes no rank files")

    @classmethod
    def consolidate_rank_files(cls, shards: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole model state of every rank's file of the ``"rank_files"`` layout, offline."""
        raise ValueError(f"{cls.__name__} writes no rank files")

    def train_step(self, module: nn.Module, optimizer: Any, loss: torch.Tensor) -> None:
        """Backward and one optimizer step."""
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    def zero_grad(self, module: nn.Module, optimizer: Any) -> None:
        """Clear the gradients for the next step.

        Through the module: ShardedDDP's own ``zero_grad`` clears its gradient buckets in
        place, where ``optimizer.zero_grad()`` would set ``.grad`` to None and detach them.
        """
        module.zero_grad()


def adam(params: Any, lr: float) -> torch.optim.Optimizer:
    """torch's Adam, the optimizer every engine trains with here."""
    return torch.optim.Adam(params, lr=lr)


def replicated(world_size: int, one: Layout) -> tuple[Layout, ...]:
    """The same layout on every rank."""
    return (one,) * world_size


def fully_sharded(num_params: int, shard: int, root_unit_params: int) -> Collectives:
    """ZeRO-3's collectives within shard groups of ``shard`` ranks.

    Reduce-scatter the gradients, gather every unit but the root twice: FSDP keeps the root
    unit unsharded from forward to backward, so only the other units are gathered again in
    backward, ``2Ψ - R``.

    Examples:
        >>> fully_sharded(1000, 2, 100).payload
        {'reduce_scatter': 1000, 'all_gather': 1900}
    """
    return Collectives(
        payload={"reduce_scatter": num_params, "all_gather": 2 * num_params - root_unit_params},
        groups={"reduce_scatter": shard, "all_gather": shard},
    )
