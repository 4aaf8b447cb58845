"""Records of what a step's peak depends on, and of what is held then (private)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class StepSizes:
    """The sizes a step's peak depends on, in bytes (what :meth:`Engine.step_peak` reads).

    Attributes:
        params: All parameters at the parameters' precision (``P · Ψ``).
        grads: All gradients at the gradients' precision (``G · Ψ``).
        largest_unit: Parameters of the largest unit (a block), at ``P``.
        largest_unit_grads: Its gradients, at ``G``.
        root_unit: Parameters of the root unit (outside the blocks), at ``P``.
        activations: What autograd saves in this rank's forward.
        blocks: How many units there are besides the root; ``None`` when not counted.
    """

    params: int
    grads: int
    largest_unit: int
    largest_unit_grads: int
    root_unit: int
    activations: int
    blocks: int | None = None


@dataclass(frozen=True, kw_only=True)
class StepPeak:
    """What a rank holds at the peak of a training step beyond the state kept between steps.

    Attributes:
        bytes: Activations and short-lived buffers at the peak.
        phase: ``"forward"``, ``"backward"`` or ``"optimizer step"``.
        kind: What makes it up, in words.

    Examples:
        >>> StepPeak(bytes=10, phase="backward", kind="activations + gradients").bytes
        10
    """

    bytes: int
    phase: str
    kind: str
