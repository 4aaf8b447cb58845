"""Lesson 05's figure: the same model cut into FSDP units by three policies.

The rows are the demo transformer's modules as a tree (block 0 stands for the four identical
blocks), each with its parameters; a column per policy colours each row by the unit that owns
its parameters. The units are the package's own: ``policy.select(model)`` on the demo model,
so the figure follows the policies' code.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from style import COLORS, new_figure

from fsdp_guide.models import Block, build_model
from fsdp_guide.wrap import LayerPolicy, SizePolicy

FONT = 11.5
# The modules shown, as (qualified name, label): block 0 stands for blocks 0 to 3.
ROWS = (
    ("", "TinyTransformer"),
    ("tok_emb", "  tok_emb"),
    ("pos_emb", "  pos_emb"),
    ("blocks.0", "  blocks.0 (of 4)"),
    ("blocks.0.ln1", "    ln1"),
    ("blocks.0.qkv", "    qkv"),
    ("blocks.0.proj", "    proj"),
    ("blocks.0.ln2", "    ln2"),
    ("blocks.0.fc1", "    fc1"),
    ("blocks.0.fc2", "    fc2"),
    ("ln_f", "  ln_f"),
    ("head", "  head"),
)
POLICIES = (
    ("root\nonly", None),
    ("Layer\nPolicy\n(Block)", LayerPolicy(Block)),
    ("Size\nPolicy\n(50k)", SizePolicy(min_num_params=50_000)),
)
# A unit's colour by how deep it sits: the root, a block, a layer inside a block.
DEPTH_COLORS = (COLORS["idle"], COLORS["compute"], COLORS["parameters"])


def _owner(name: str, units: list[str]) -> str:
    """The innermost unit holding module ``name`` ("" for the root unit)."""
    holding = [u for u in units if name == u or name.startswith(f"{u}.")]
    return max(holding, key=len, default="")


def unit_tree() -> Figure:
    """The module tree, a column per policy, each row coloured by its unit."""
    model = build_model("transformer", seed=0)
    modules = dict(model.named_modules())
    figure = new_figure(6.0, 6.2)
    ax = figure.subplots()
    top = len(ROWS)
    for row, (name, label) in enumerate(ROWS):
        y = top - 1 - row
        own = sum(p.numel() for p in modules[name].parameters(recurse=False))
        indent = 0.3 * (len(label) - len(label.lstrip())) / 2  # SVG text drops leading spaces
        ax.text(indent, y + 0.5, label.strip(), ha="left", va="center", fontsize=FONT,
                family="monospace")  # fmt: skip
        if own:
            ax.text(4.6, y + 0.5, f"{own:,}", ha="right", va="center", fontsize=FONT)
        for column, (_, policy) in enumerate(POLICIES):
            units = policy.select(model) if policy is not None else []
            owner = _owner(name, units)
            depth = 0 if not owner else owner.count(".")
            color = DEPTH_COLORS[min(depth, 2)]
            x = 5.0 + column * 1.35
            ax.add_patch(Rectangle((x, y + 0.08), 1.15, 0.84, facecolor=color, edgecolor="white"))
            if owner == name:  # the module that is the unit
                ax.text(x + 0.575, y + 0.5, "unit", ha="center", va="center", fontsize=FONT - 1,
                        color="white" if depth == 2 else COLORS["text"])  # fmt: skip
    for column, (title, _) in enumerate(POLICIES):
        ax.text(5.575 + column * 1.35, top + 0.15, title, ha="center", va="bottom",
                fontsize=FONT, linespacing=1.0)  # fmt: skip
    ax.text(4.6, top + 0.15, "own\nparams", ha="right", va="bottom", fontsize=FONT - 0.5)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in DEPTH_COLORS]
    labels = ["the root unit", "a block's unit", "a layer's unit"]
    figure.legend(handles, labels, loc="lower center", ncols=3, frameon=False, fontsize=FONT)
    ax.set_xlim(0, 9.2)
    ax.set_ylim(0, top + 1.9)
    ax.axis("off")
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    return figure


FIGURES = {"05_unit_tree.svg": unit_tree}
