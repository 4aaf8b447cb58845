"""How many ranks a lesson starts, and on which devices: one GPU each, or the CPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fsdp_guide.launcher._checks import _gpu_count, check_world_size


@dataclass(frozen=True)
class RankPlan:
    """The ranks a lesson launches: ``world_size`` of them, under ``backend``.

    Attributes:
        world_size: Number of ranks.
        backend: ``"nccl"`` (one GPU per rank) or ``"gloo"`` (every rank on the CPU).
        gpus: GPUs visible to this process when the plan was made.
    """

    world_size: int
    backend: Literal["nccl", "gloo"]
    gpus: int

    @property
    def accelerator(self) -> Literal["gpu", "cpu"]:
        """The matching Lightning ``Trainer(accelerator=...)``."""
        return "gpu" if self.backend == "nccl" else "cpu"

    def __str__(self) -> str:
        if self.backend == "nccl":
            return f"{self.world_size} ranks, one GPU each, NCCL ({self.gpus} GPUs visible)"
        why = "no GPU visible" if self.gpus == 0 else f"{self.gpus} GPU visible, NCCL needs 2"
        return f"{self.world_size} ranks on the CPU, gloo ({why})"


def plan_ranks(cpu_world_size: int = 2) -> RankPlan:
    """A rank per GPU when there are at least two GPUs, else ``cpu_world_size`` CPU ranks.

    One GPU is not enough: two NCCL ranks cannot share a GPU, and a lesson about sharding
    needs two ranks at least. The number of GPU ranks is the largest power of two up to the
    number of GPUs (all of them on the usual 2, 4 or 8), so that the lessons' batches of 8
    and 16 split evenly. In a notebook, call it before anything touches CUDA: it only
    counts devices, which keeps forking the ranks safe.

    Args:
        cpu_world_size: Ranks to start on the CPU (gloo) when fewer than two GPUs are
            visible.

    Returns:
        The plan; ``str(plan)`` says in words which one it is, for the lesson to print.

    Raises:
        ValueError: ``cpu_world_size`` is not a positive int.

    Examples:
        >>> plan = plan_ranks(cpu_world_size=2)
        >>> plan.backend in ("nccl", "gloo") and plan.world_size >= 2
        True
        >>> print(RankPlan(world_size=2, backend="gloo", gpus=0))
        2 ranks on the CPU, gloo (no GPU visible)
        >>> print(RankPlan(world_size=4, backend="nccl", gpus=4))
        4 ranks, one GPU each, NCCL (4 GPUs visible)
    """
    cpu_world_size = check_world_size(cpu_world_size)
    gpus = _gpu_count()
    if gpus >= 2:
        return RankPlan(world_size=1 << (gpus.bit_length() - 1), backend="nccl", gpus=gpus)
    return RankPlan(world_size=cpu_world_size, backend="gloo", gpus=gpus)
