"""Lesson 13's figure: one FSDP training step in time, drawn as a rank's memory by kind, with
the collectives underneath: each block gathered just before it runs and freed after it,
activations piling up in forward and draining in backward, the peak early in backward."""

from __future__ import annotations

from matplotlib.figure import Figure
from style import COLORS, new_figure

BLOCKS = 4
SHARD = 0.5  # a block's parameters on one rank of 2, in units of a whole block
ACTIVATIONS = 1.2  # what one block saves for backward, in the same units
OPTIMIZER = 2 * SHARD * BLOCKS  # Adam's two moments of the rank's shards
RUN, FREE = 1.0, 0.25  # widths of a block's slot and of the gap after it


def _slots() -> list[tuple[float, dict[str, float], str]]:
    """The step cut into slots: (width, bytes held by kind, collective running)."""
    slots: list[tuple[float, dict[str, float], str]] = []
    saved, grads = 0.0, 0.0
    for _ in range(BLOCKS):  # forward: gather a block, run it (it saves), free it
        slots.append((RUN, {"gathered": 1, "activations": saved, "grads": 0}, "all-gather"))
        saved += ACTIVATIONS
        slots.append((FREE, {"gathered": 0, "activations": saved, "grads": 0}, ""))
    for block in range(BLOCKS):  # backward: the block and the next one gathered, then
        ahead = 1 if block < BLOCKS - 1 else 0  # its gradients reduce-scattered to shards
        slots.append(
            (RUN, {"gathered": 1 + ahead, "activations": saved, "grads": grads + 1}, "all-gather")
        )
        saved -= ACTIVATIONS
        slots.append(
            (
                RUN / 2,
                {"gathered": ahead, "activations": saved, "grads": grads + 1},
                "reduce-scatter",
            )
        )
        grads += SHARD
    slots.append((RUN, {"gathered": 0, "activations": 0, "grads": grads}, ""))
    return slots


def step_in_time() -> Figure:
    figure = new_figure(5.6, 4.4)
    top = figure.add_axes((0.2, 0.42, 0.78, 0.52))
    lane = figure.add_axes((0.2, 0.27, 0.78, 0.1), sharex=top)
    xs: list[float] = []
    kinds: dict[str, list[float]] = {
        "parameters": [],
        "optimizer": [],
        "gradients": [],
        "activations": [],
    }
    x = 0.0
    starts = []
    for width, held, _ in _slots():
        starts.append(x)
        for at in (x, x + width):  # flat over the slot
            xs.append(at)
            kinds["parameters"].append(SHARD * BLOCKS + held["gathered"])
            kinds["optimizer"].append(OPTIMIZER)
            kinds["gradients"].append(held["grads"])
            kinds["activations"].append(held["activations"])
        x += width
    end = x
    top.stackplot(xs, *kinds.values(), colors=[COLORS[k] for k in kinds], labels=list(kinds), lw=0)
    totals = [sum(v) for v in zip(*kinds.values(), strict=True)]
    peak = max(totals)
    where = xs[totals.index(peak)]
    top.annotate(
        "peak",
        (where + 0.4, peak),
        xytext=(where + 1.6, peak + 1.1),
        fontsize=12,
        arrowprops={"arrowstyle": "-|>", "color": COLORS["text"]},
        va="center",
    )
    forward_end = BLOCKS * (RUN + FREE)
    backward_end = forward_end + BLOCKS * 1.5 * RUN
    top.axvspan(forward_end, backward_end, color="black", alpha=0.07, lw=0)
    for name, a, b in (
        ("forward", 0, forward_end),
        ("backward", forward_end, backward_end),
        ("step", backward_end, end),
    ):
        top.text((a + b) / 2, peak + 2.9, name, ha="center", va="top", fontsize=12)
    top.set_ylim(0, peak + 3.0)
    top.set_yticks([])
    top.set_ylabel("bytes held", fontsize=12)
    top.spines[["top", "right"]].set_visible(False)
    top.tick_params(labelbottom=False, bottom=False)
    rows = {"all-gather": 1, "reduce-scatter": 0}
    for start, (width, _, comm) in zip(starts, _slots(), strict=True):
        if comm:
            size = 0.45 if comm == "all-gather" else width * 0.8
            lane.barh(
                rows[comm], size, left=start + 0.05, height=0.7, color=COLORS["communication"]
            )
    lane.set_yticks([0, 1], ["reduce-scatter", "all-gather"], fontsize=12)
    lane.tick_params(left=False)
    lane.set_ylim(-0.6, 1.6)
    lane.set_xlim(0, end)
    lane.set_xticks([])
    lane.set_xlabel("time", fontsize=12)
    lane.spines[["top", "right", "left"]].set_visible(False)
    handles, labels = top.get_legend_handles_labels()
    figure.legend(
        handles,
        labels,
        loc="lower center",
        bbox_to_anchor=(0.55, 0.0),
        ncol=2,
        frameon=False,
        fontsize=12,
        handlelength=1.2,
        columnspacing=1.2,
    )
    return figure


FIGURES = {"13_step_in_time.svg": step_in_time}
