"""The "will it fit" table of the guide, planned at build time with ``fsdp_guide.memory.plan``.

The demo transformer is scaled to GPT-2, 1B, 7B and 70B dimensions and planned on 8 and 64
GPUs, without allocating a byte of it (meta device and fake tensors). Planning takes a few
seconds, so the table is cached in ``docs/_generated/``, keyed by a hash of the code that
computes it: a build after a change to the planner or the models plans again.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# (name, TransformerConfig fields): GPT-2 small, and the widths/depths of 1B, 7B, 70B models.
SCALES: tuple[tuple[str, dict[str, int]], ...] = (
    ("GPT-2", {"vocab_size": 50257, "dim": 768, "n_heads": 12, "n_layers": 12, "seq_len": 1024}),
    ("1B", {"vocab_size": 32000, "dim": 2048, "n_heads": 16, "n_layers": 22, "seq_len": 2048}),
    ("7B", {"vocab_size": 32000, "dim": 4096, "n_heads": 32, "n_layers": 32, "seq_len": 4096}),
    ("70B", {"vocab_size": 32000, "dim": 8192, "n_heads": 64, "n_layers": 86, "seq_len": 4096}),
)
WORLD_SIZES = (8, 64)
GPU_BYTES = 80 * 10**9
MARGIN = 0.1
# FSDP2 rather than FSDP1's FULL_SHARD: the same bytes, on the engine PyTorch maintains.
STRATEGIES = ("ddp", "zero1", "sharded_ddp", "fsdp_grad_op", "fsdp2")
# What the table depends on: a change to any of these plans it again.
_SOURCES = (
    "fsdp_guide/memory/_plan.py",
    "fsdp_guide/memory/_plan_record.py",
    "fsdp_guide/memory/_profile.py",
    "fsdp_guide/memory/_recommend.py",
    "fsdp_guide/memory/_request.py",
    "fsdp_guide/memory/_dimensions.py",
    "fsdp_guide/memory/_tp.py",
    "fsdp_guide/memory/_predict.py",
    "fsdp_guide/memory/_trace.py",
    "fsdp_guide/memory/_zero.py",
    "fsdp_guide/comm/_predict.py",
    "fsdp_guide/catalog/_table.py",
    "fsdp_guide/models.py",
    "fsdp_guide/inputs.py",
    "fsdp_guide/outputs.py",
    "fsdp_guide/wrap/_activations.py",
)


def _key(repo: Path) -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    engines = sorted(str(p.relative_to(repo)) for p in (repo / "fsdp_guide/engines").glob("*.py"))
    for name in (*_SOURCES, *engines):  # every engine lays its state out and plans its step
        digest.update((repo / name).read_bytes())
    return digest.hexdigest()[:16]


def fit_table() -> str:
    """The Markdown table: the step's peak in GB per GPU of each strategy, and the
    recommended one."""
    import torch

    from fsdp_guide.memory import plan, recommend
    from fsdp_guide.models import TinyTransformer, TransformerConfig

    # Few, short columns: the table must fit a laptop's screen beside the site's sidebars.
    header = ["model", "GPUs", "act.", *STRATEGIES, "recommended"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name, fields in SCALES:
        cfg = TransformerConfig(**fields)
        with torch.device("meta"):
            model = TinyTransformer(cfg)
        for world_size in WORLD_SIZES:
            # One trace per way of running bf16, shared by the strategies (same model object).
            plans = [
                plan(
                    model,
                    batch_size=1,
                    seq_len=cfg.seq_len,
                    world_size=world_size,
                    strategy=s,
                    precision="mixed",
                    activation_checkpointing="blocks",
                )
                for s in STRATEGIES
            ]
            best = recommend(plans, GPU_BYTES, MARGIN)
            cells = [f"{name} ({plans[0].num_params / 1e9:.2f}B)", str(world_size)]
            cells.append(f"{plans[-1].activations / 1e9:.1f}")
            for p in plans:
                fits = p.fits(GPU_BYTES, MARGIN)
                cells.append(f"{p.step_peak / 1e9:.1f}" + ("" if fits else " ✗"))
            cells.append(f"`{best.strategy}`" if best else "more GPUs")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def generate_fit_table(repo: Path, target: Path) -> None:
    """Write :func:`fit_table` to ``target``, unless the cached one is still current."""
    key = _key(repo)
    stamp = f"<!-- fit-table {key} -->\n"
    if target.exists() and target.read_text(encoding="utf-8").startswith(stamp):
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(stamp + fit_table(), encoding="utf-8")
