"""Ring attention's steps in time: recorded on each rank, drawn rank by rank (private)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple


class RingStep(NamedTuple):
    """One ring step's attention compute on one rank.

    Attributes:
        phase: ``"forward"`` or ``"backward"``.
        step: The step of the ring, from 0.
        start: When the compute started (:func:`time.perf_counter` seconds: one clock for
            every process of a machine).
        end: When it ended.
        share: The part of a full block computed (0 when the step only passes a block on).
        cpu: CPU seconds the compute took on its thread (:func:`time.thread_time`): its
            length on a core of its own, whatever else the machine runs.
    """

    phase: str
    step: int
    start: float
    end: float
    share: float
    cpu: float


#: What :func:`record_ring_steps` yields each step as, to a type checker: a :class:`RingStep`
#: is this tuple, its fields named.
Step = tuple[str, int, float, float, float, float]

_steps: list[Step] | None = None


@contextmanager
def record_ring_steps() -> Iterator[list[Step]]:
    """Record each ring step this process computes while the block runs, in order.

    Each is a named tuple ``(phase, step, start, end, share, cpu)``: ``"forward"`` or
    ``"backward"``, the step of the ring, :func:`time.perf_counter` seconds around the
    step's attention compute, the part of a full block it computed, and the CPU seconds it
    took.

    Examples:
        >>> import torch
        >>> from fsdp_guide.parallel import ring_attention
        >>> q = k = v = torch.randn(1, 1, 4, 2)
        >>> with record_ring_steps() as steps:
        ...     _ = ring_attention(q, k, v, causal=True)
        >>> [(s.phase, s.step, s.share) for s in steps]
        [('forward', 0, 1.0)]
    """
    global _steps
    previous, _steps = _steps, []
    try:
        yield _steps
    finally:
        _steps = previous


def record(phase: str, step: int, started: tuple[float, float], share: float) -> None:
    """Note a step that started at ``started`` (wall, thread CPU seconds) and ends now."""
    if _steps is not None:
        wall, cpu = started
        _steps.append(
            RingStep(phase, step, wall, time.perf_counter(), share, time.thread_time() - cpu)
        )


# The shared look of the guide's figures: compute, gradients, idle.
_COLORS = {"forward": "#56B4E9", "backward": "#E69F00", "idle": "#BBBBBB"}


def _span(ranks: Sequence[Sequence[Step]]) -> tuple[float, float]:
    """(first start, last end) over every rank's steps."""
    return min(e[2] for r in ranks for e in r), max(e[3] for r in ranks for e in r)


def idle_shares(ranks: Sequence[Sequence[Step]]) -> list[float]:
    """Each rank's share of the call spent waiting: from the ranks' first start to the last
    rank's end, the time it computed nothing.

    Examples:
        >>> one = RingStep("forward", 0, start=0.0, end=1.0, share=1.0, cpu=1.0)
        >>> idle_shares([[one], [one._replace(end=2.0)]])
        [0.5, 0.0]
    """
    start, end = _span(ranks)
    return [1 - sum(e[3] - e[2] for e in events) / (end - start) for events in ranks]


def plot_ring_steps(calls: Mapping[str, Sequence[Sequence[Step]]], width: float = 6.0) -> Any:
    """A figure of recorded ring calls: for each label, a row per rank, each ring step's
    compute as a bar (forward, then backward) and the rest of the call, idle, in grey; each
    row says the rank's idle share.

    Args:
        calls: Label (a layout, say) to one call's steps on each rank, ``[rank][step]``,
            as :func:`~fsdp_guide.parallel.record_ring_steps` recorded them.
        width: The figure's width in inches.

    Returns:
        A matplotlib ``Figure``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = sum(len(ranks) for ranks in calls.values()) + len(calls) - 1
    figure, ax = plt.subplots(figsize=(width, 1.4 + 0.6 * rows))
    ticks: list[tuple[int, str]] = []
    y = 0
    for label, ranks in calls.items():
        start, end = _span(ranks)
        idle = idle_shares(ranks)
        for rank, events in enumerate(ranks):
            ax.barh(y, (end - start) * 1e3, height=0.7, color=_COLORS["idle"])
            for phase, _, t0, t1, *_ in events:
                ax.barh(
                    y,
                    (t1 - t0) * 1e3,
                    left=(t0 - start) * 1e3,
                    height=0.7,
                    color=_COLORS[phase],
                    edgecolor="white",  # a thin gap between one ring step and the next
                    linewidth=0.8,
                )
            ticks.append((y, f"{label}, rank {rank}\n(idle {idle[rank]:.0%})"))
            y += 1
        y += 1
    ax.set_yticks([t for t, _ in ticks], [text for _, text in ticks])
    ax.invert_yaxis()
    ax.set_xlabel("time from the ranks' common start (ms)")
    handles = [Patch(color=c, label=f"{k} step" if k != "idle" else k) for k, c in _COLORS.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3,
              frameon=False)  # fmt: skip
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    figure.tight_layout()
    return figure
