"""What :func:`fsdp_guide.memory.plan` says of a pipeline: ``PipelinePlan`` (private)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp_guide.memory._schedule import PipelineSchedule

if TYPE_CHECKING:
    from fsdp_guide.memory._plan_record import Plan


@dataclass(frozen=True, kw_only=True)
class PipelinePlan:
    """The pipeline of a :class:`~fsdp_guide.memory.Plan`: stages, schedule, each rank's plan.

    Ranks are numbered on a ``(pp, dp, tp)`` mesh, row-major: rank ``r`` is pipeline rank
    ``r // (dp · tp)``.

    Attributes:
        schedule: The schedule's actions per pipeline rank (its step structure).
        layers: ``layers[s]``: the class names of the layers stage ``s`` holds.
        boundary_elements: ``boundary_elements[s]``: elements of stage ``s``'s output for one
            micro-batch, what its forward sends (and its input's gradient, back).
        peak_in_flight: ``peak_in_flight[r]``: micro-batches each stage of pipeline rank
            ``r`` holds activations for at its peak.
        rank_plans: ``rank_plans[r]``: the plan of pipeline rank ``r``'s ranks: its state,
            its activation peak, its communication (the engine's collectives over ``dp``,
            tensor parallelism's over ``tp``, and its sends and receives).
    """

    schedule: PipelineSchedule
    layers: tuple[tuple[str, ...], ...]
    boundary_elements: tuple[int, ...]
    peak_in_flight: tuple[dict[int, int], ...]
    rank_plans: tuple[Plan, ...]

    @property
    def ranks_per_stage(self) -> int:
        """Ranks in each pipeline rank's ``(dp, tp)`` group."""
        return self.rank_plans[0].world_size // self.schedule.ranks

    def pipeline_rank(self, rank: int) -> int:
        """The pipeline rank of global ``rank``."""
        return rank // self.ranks_per_stage

    def plan_of(self, rank: int) -> Plan:
        """The plan of the pipeline rank that global ``rank`` belongs to."""
        return self.rank_plans[self.pipeline_rank(rank)]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages global ``rank`` holds."""
        return self.schedule.rank_stages(self.pipeline_rank(rank))

    @property
    def bubble(self) -> float:
        """The textbook idle share of a step, ``(p - 1) / (v · m + p - 1)``."""
        return self.schedule.formula_bubble
