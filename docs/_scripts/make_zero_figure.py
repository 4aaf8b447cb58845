"""Draw ``docs/_static/zero_stages.svg``: what each rank holds under DDP and ZeRO 1 to 3.

Run from the repository root after changing the figure (the SVG is committed)::

    python docs/_scripts/make_zero_figure.py

Mixed-precision Adam as in the ZeRO paper: per parameter, 2 bytes of fp16 weights, 2 of
fp16 gradients and 12 of optimizer state (fp32 master weights and two moments). Every
rank row shows those three blocks; a sharded block is filled only over the rank's own
slice, the rest of it lives on the other ranks.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

WORLD_SIZE = 4
# (name, bytes per parameter); widths in the figure are proportional to these.
STATES = (("parameters", 2.0), ("gradients", 2.0), ("optimizer state", 12.0))
COLORS = {"parameters": "#3b75af", "gradients": "#ef8636", "optimizer state": "#519e3e"}
# (title, which states are sharded)
STAGES = (
    ("DDP: everything replicated", set()),
    ("ZeRO-1: optimizer state sharded", {"optimizer state"}),
    ("ZeRO-2: + gradients sharded", {"optimizer state", "gradients"}),
    ("ZeRO-3: + parameters sharded", {"optimizer state", "gradients", "parameters"}),
)
OUTPUT = Path(__file__).resolve().parent.parent / "_static" / "zero_stages.svg"


def bytes_per_rank(sharded: set[str]) -> float:
    """Bytes per parameter that one rank holds."""
    return sum(size / WORLD_SIZE if name in sharded else size for name, size in STATES)


def draw(output: Path = OUTPUT) -> None:
    """Draw the figure and save it as a compact SVG (text kept as text)."""
    plt.rcParams["svg.fonttype"] = "none"
    plt.rcParams["svg.hashsalt"] = "fsdp-guide"  # same ids on every run: diffs stay small
    total = sum(size for _, size in STATES)
    fig, axes = plt.subplots(len(STAGES), 1, figsize=(8.0, 7.2), sharex=True)
    for ax, (title, sharded) in zip(axes, STAGES, strict=True):
        for rank in range(WORLD_SIZE):
            y = WORLD_SIZE - 1 - rank
            x = 0.0
            for name, size in STATES:
                color = COLORS[name]
                if name in sharded:
                    # Outline of the whole block, filled only over this rank's slice.
                    ax.add_patch(Rectangle((x, y + 0.1), size, 0.8, fill=False, ec=color, lw=1))
                    width = size / WORLD_SIZE
                    ax.add_patch(Rectangle((x + rank * width, y + 0.1), width, 0.8, color=color))
                else:
                    ax.add_patch(Rectangle((x, y + 0.1), size, 0.8, color=color))
                x += size
            ax.text(-0.3, y + 0.5, f"rank {rank}", ha="right", va="center", fontsize=9)
        ax.text(
            total + 0.3,
            WORLD_SIZE / 2,
            f"{bytes_per_rank(sharded):g} bytes\nper parameter\nper rank",
            va="center",
            fontsize=9,
        )
        ax.set_title(title, loc="left", fontsize=11)
        ax.set_xlim(-2.2, total + 3.2)
        ax.set_ylim(0, WORLD_SIZE)
        ax.axis("off")
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[name]) for name, _ in STATES]
    labels = [f"{name} ({size:g} B/param)" for name, size in STATES]
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False, fontsize=9)
    fig.suptitle(
        f"What each of {WORLD_SIZE} ranks holds (mixed-precision Adam); "
        "outlined = held by the other ranks",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    draw()
    print(f"wrote {OUTPUT}")
