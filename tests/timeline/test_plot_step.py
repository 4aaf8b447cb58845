"""A recorded step's plot() draws every collective, the phases, and the peak in view."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from fsdp_guide.timeline import CATEGORIES, CollectiveEvent, StepTimeline


def _timeline(events: int, peak_at: int) -> StepTimeline:
    times = tuple(float(t) for t in range(events))
    held = tuple(10 if i == peak_at else 4 for i in range(events))
    third = events / 3
    return StepTimeline(
        times_us=times,
        bytes={c: held for c in CATEGORIES},
        phases=(
            ("forward", 0.0, third),
            ("backward", third, 2 * third),
            ("optimizer step", 2 * third, float(events)),
        ),
        collectives=(
            CollectiveEvent(kind="all_gather", bytes=8, start_us=1.0, end_us=2.0),
            CollectiveEvent(kind="reduce_scatter", bytes=8, start_us=40.0, end_us=41.0),
            CollectiveEvent(kind="broadcast", bytes=8, start_us=50.0, end_us=51.0),
        ),
        state_before=20,
    )


def test_every_collective_is_drawn_on_its_row() -> None:
    figure = _timeline(90, peak_at=45).plot("step")
    _, lane = figure.axes
    rows = sorted(bar.get_y() + bar.get_height() / 2 for bar in lane.patches)
    assert rows == [0.0, 0.5, 1.0]  # reduce-scatter, other, all-gather


def test_a_peak_late_in_the_optimizer_step_stays_in_view() -> None:
    # 900 events: the optimizer step starts at 600 and is cut 80 events in, unless the
    # peak is later.
    figure = _timeline(900, peak_at=800).plot()
    assert figure.axes[1].get_xlim()[1] >= 800
    assert _timeline(900, peak_at=100).plot().axes[1].get_xlim()[1] == 680
