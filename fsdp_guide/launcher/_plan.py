"""How many ranks a lesson starts, and on which devices: one GPU each, or the CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from fsdp_guide.launcher._checks import _gpu_count, check_world_size

RANKS_ENV = "FSDP_GUIDE_RANKS"


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
            ranks = "1 rank on one GPU" if self.world_size == 1 else f"{self.world_size} ranks"
            each = "" if self.world_size == 1 else ", one GPU each"
            visible = "1 GPU" if self.gpus == 1 else f"{self.gpus} GPUs"
            return f"{ranks}{each}, NCCL ({visible} visible)"
        why = "no GPU visible" if self.gpus == 0 else f"{self.gpus} GPU visible, NCCL needs 2"
        return f"{self.world_size} ranks on the CPU, gloo ({why})"


def plan_ranks(cpu_world_size: int = 2) -> RankPlan:
    """A rank per GPU when there are at least two GPUs, else ``cpu_world_size`` CPU ranks.

    One GPU is not enough: two NCCL ranks cannot share a GPU, and a lesson about sharding
    needs two ranks at least. The number of GPU ranks is the largest power of two up to the
    number of GPUs (all of them on the usual 2, 4 or 8), so that the lessons' batches of 8
    and 16 split evenly. In a notebook, call it before anything touches CUDA: it only
    counts devices, which keeps forking the ranks safe.

    The environment variable ``FSDP_GUIDE_RANKS`` overrides the choice for every lesson at
    once: ``nccl:1`` runs one NCCL rank on a machine with a single GPU (the device path a
    multi-GPU workstation takes, at world size 1), ``gloo:4`` four CPU ranks.

    Args:
        cpu_world_size: Ranks to start on the CPU (gloo) when fewer than two GPUs are
            visible.

    Returns:
        The plan; ``str(plan)`` says in words which one it is, for the lesson to print.

    Raises:
        ValueError: ``cpu_world_size`` is not a positive int.
        ValueError: ``FSDP_GUIDE_RANKS`` is not ``BACKEND:N``, or asks for more NCCL ranks
            than there are GPUs.

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
    forced = os.environ.get(RANKS_ENV, "").strip()
    if forced:
        return _forced(forced, gpus)
    if gpus >= 2:
        return RankPlan(world_size=1 << (gpus.bit_length() - 1), backend="nccl", gpus=gpus)
    return RankPlan(world_size=cpu_world_size, backend="gloo", gpus=gpus)


def _forced(value: str, gpus: int) -> RankPlan:
    """The plan ``FSDP_GUIDE_RANKS=BACKEND:N`` asks for, checked against the GPUs here."""
    backend, _, count = value.partition(":")
    if backend not in ("nccl", "gloo") or not count.isdigit() or int(count) < 1:
        raise ValueError(
            f"{RANKS_ENV}={value!r}: write BACKEND:N with BACKEND nccl or gloo and N >= 1, "
            f"e.g. {RANKS_ENV}=nccl:1, or unset it to let plan_ranks() choose"
        )
    world_size = int(count)
    if backend == "nccl" and world_size > gpus:
        raise ValueError(
            f"{RANKS_ENV}={value!r} asks for {world_size} NCCL ranks but {gpus} GPUs are "
            f"visible: one NCCL rank needs a GPU of its own; ask for at most {gpus}, or gloo"
        )
    kind: Literal["nccl", "gloo"] = "nccl" if backend == "nccl" else "gloo"
    return RankPlan(world_size=world_size, backend=kind, gpus=gpus)
