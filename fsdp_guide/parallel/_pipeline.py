"""A pipeline on this rank: its stages and a named schedule of ``torch.distributed.pipelining``
(private).

:func:`build_pipeline` cuts the model as the planner does
(:func:`fsdp_guide.memory.pipeline_stages`), keeps the stages the schedule gives this rank,
wraps each in torch's ``PipelineStage`` and builds torch's schedule; with a data-parallel
mesh it first applies FSDP2 to each stage as torchtitan does. ``Pipeline.step`` runs one
step and records, per action, when it ran and, on request, the bytes autograd holds.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from torch import Tensor, nn

from fsdp_guide.memory import PipelineSchedule, pipeline_schedule, pipeline_stages


class SavedTensors:
    """The activations autograd holds, read at moments of a pipeline step.

    While :meth:`tracking` is active, every tensor saved for backward is remembered by a weak
    reference; :meth:`held` counts the storages still alive, each once, leaving out the
    parameters' (as :func:`fsdp_guide.wrap.saved_activation_bytes` counts at forward's end).
    """

    def __init__(self, modules: nn.Module) -> None:
        self.modules = modules
        self.saved: list[weakref.ref[Tensor]] = []
        self.peak = 0

    def pack(self, tensor: Tensor) -> Tensor:
        held = tensor.detach()  # not the tensor itself: that would be a reference cycle
        self.saved.append(weakref.ref(held))
        return held

    def held(self) -> int:
        """Bytes of the saved storages alive now, parameters' left out."""
        params = set()
        for p in self.modules.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            params.add(local.untyped_storage().data_ptr())
        alive: dict[int, int] = {}
        kept = []
        for ref in self.saved:
            tensor = ref()
            if tensor is None:
                continue
            kept.append(ref)
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in params:
                alive[storage.data_ptr()] = storage.nbytes()
        self.saved = kept
        return sum(alive.values())

    def mark(self) -> None:
        """Read the bytes held now into the peak."""
        self.peak = max(self.peak, self.held())


@cache
def _recording_stage() -> type:
    """torch's ``PipelineStage``, recording each action's start and end (and the bytes held
    around it when a :class:`SavedTensors` is attached)."""
    from torch.distributed.pipelining import PipelineStage

    class RecordingStage(PipelineStage):
        records: list[tuple[str, float, float]]
        tracker: SavedTensors | None = None

        def _timed(self, kind: str, chunk: int, run: Callable[[], Any]) -> Any:
            if self.tracker is not None:
                self.tracker.mark()
            start = time.perf_counter()
            out = run()
            self.records.append((f"{self.stage_index}{kind}{chunk}", start, time.perf_counter()))
            if self.tracker is not None:
                self.tracker.mark()
            return out

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            run = super().forward_one_chunk
            return self._timed("F", fwd_chunk_id, lambda: run(fwd_chunk_id, *args, **kwargs))

        def backward_one_chunk(
            self,
            bwd_chunk_id: int,
            loss: Any = None,
            full_backward: bool = True,
            last_backward: Any = False,
        ) -> Any:
            run = super().backward_one_chunk
            return self._timed(
                "B" if full_backward else "I",
                bwd_chunk_id,
                lambda: run(bwd_chunk_id, loss, full_backward, last_backward),
            )

        def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            run = super().backward_weight_one_chunk
            return self._timed("W", bwd_chunk_id, lambda: run(bwd_chunk_id, *args, **kwargs))

    return RecordingStage


@dataclass
class Pipeline:
    """This rank's part of a pipeline (what :func:`build_pipeline` returns).

    Attributes:
        modules: The stages this rank holds, in stage order (give their parameters to the
            optimizer).
        stages: torch's ``PipelineStage`` of each.
        schedule: torch's schedule object.
        actions: The schedule's step structure (:func:`fsdp_guide.memory.pipeline_schedule`).
        rank: This rank's position in the pipeline.
        timeline: The last step's actions on this rank: ``(action, start, end)``, in seconds
            of ``time.perf_counter`` (one clock for every process of a machine).
        activations: The most bytes autograd held at once in the last step run with
            ``activations=True`` (parameters left out).
    """

    modules: nn.ModuleList
    stages: list[Any]
    schedule: Any
    actions: PipelineSchedule
    rank: int
    timeline: list[tuple[str, float, float]] = field(default_factory=list)
    activations: int = 0

    @property
    def holds_first(self) -> bool:
        """Whether this rank holds stage 0 (it takes the inputs)."""
        return 0 in self.actions.rank_stages(self.rank)

    @property
    def holds_last(self) -> bool:
        """Whether this rank holds the last stage (it takes the targets, computes the loss)."""
        return self.actions.stages - 1 in self.actions.rank_stages(self.rank)

    def step(
        self, inputs: Any = None, targets: Any = None, *, activations: bool = False
    ) -> float | None:
        """One step of the schedule over the whole batch, split into micro-batches by torch.

        Every rank calls it; the inputs matter only where :attr:`holds_first`, the targets
        where :attr:`holds_last`. Gradients are accumulated (and scaled by the number of
        micro-batches, as a mean loss is); call the optimizer after it.

        Args:
            inputs: The batch's inputs.
            targets: The batch's targets.
            activations: Also track the bytes autograd holds (into :attr:`activations`).

        Returns:
            The mean loss of the micro-batches where this rank holds the last stage, else
            ``None``.
        """
        self.timeline = []
        tracker = SavedTensors(self.modules) if activations else None
        for stage in self.stages:  # one record and one tracker for all of the rank's stages
            stage.records, stage.tracker = self.timeline, tracker
        losses: list[Tensor] = []
        args = (inputs,) if self.holds_first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self.holds_last else {}
        if tracker is None:
            self.schedule.step(*args, **kwargs)
        else:
            with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
                self.schedule.step(*args, **kwargs)
            self.activations = tracker.peak
        self.timeline.sort(key=lambda record: record[1])
        if not losses:
            return None
        return float(torch.stack([loss.detach() for loss in losses]).mean())


def build_pipeline(
    model: nn.Module,
    *,
    schedule: str = "1F1B",
    microbatches: int,
    stages_per_rank: int | None = None,
    group: Any = None,
    dp_mesh: Any = None,
    device: torch.device | None = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
) -> Pipeline:
    """This rank's stages of ``model`` and torch's ``schedule`` to run them.

    The model is cut as :func:`fsdp_guide.memory.plan` cuts it
    (:func:`fsdp_guide.memory.pipeline_stages`): ``p · v`` contiguous stages of its layers,
    this rank keeping those the schedule puts on it (stage ``s`` on rank ``s % p``; for
    ``ZBVZeroBubble`` the V: ``r`` and ``2p - 1 - r``). Each is wrapped in torch's
    ``PipelineStage``; torch runs the schedule, sends the activations and gradients between
    ranks, and splits each batch into ``microbatches``.

    Args:
        model: An ``nn.Sequential`` or a model with ``pipeline_layers()``, the same on every
            rank of the pipeline (built with the same seed), on ``device``.
        schedule: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``,
            ``"InterleavedZeroBubble"`` or ``"ZBVZeroBubble"``.
        microbatches: Micro-batches per step.
        stages_per_rank: Stages per rank (1 for GPipe and 1F1B, 2 by default otherwise).
        group: The pipeline's process group (every rank by default).
        dp_mesh: A 1-D device mesh of data-parallel ranks: each layer of each stage, then the
            stage, is sharded with FSDP2's ``fully_shard`` over it
            (``reshard_after_forward=False``, as torchtitan does with a pipeline).
        device: This rank's device (:func:`fsdp_guide.launcher.rank_device` by default).
        loss_fn: ``loss_fn(output, target)`` on the last stage; by default cross-entropy for
            integer targets, mean squared error for floating ones
            (``output_loss``, what a model's output and the targets give as its loss).

    Returns:
        A ``Pipeline``.

    Raises:
        PlanError: An unknown schedule, more stages than layers, or micro-batches the
            schedule refuses.
    """
    import torch.distributed as dist
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    from fsdp_guide.launcher import rank_device
    from fsdp_guide.outputs import output_loss

    device = device or rank_device()
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    actions = pipeline_schedule(
        schedule, ranks=p, microbatches=microbatches, stages_per_rank=stages_per_rank
    )
    everything = pipeline_stages(model, actions.stages)
    mine = actions.rank_stages(rank)
    modules = nn.ModuleList(everything[s] for s in mine)
    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for stage_module in modules:
            for layer in stage_module.children():
                fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False)
            fully_shard(stage_module, mesh=dp_mesh, reshard_after_forward=False)
    stage_class = _recording_stage()
    stages = [
        stage_class(module, s, actions.stages, device, group=group)
        for s, module in zip(mine, modules, strict=True)
    ]
    cls = get_schedule_class(actions.name)
    loss = loss_fn or output_loss
    torch_schedule = (
        cls(stages[0], microbatches, loss_fn=loss)
        if issubclass(cls, PipelineScheduleSingle)
        else cls(stages, microbatches, loss_fn=loss)
    )
    return Pipeline(
        modules=modules, stages=stages, schedule=torch_schedule, actions=actions, rank=rank
    )
