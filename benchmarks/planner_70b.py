"""Time and peak memory of planning a 70B-parameter model, the planner's acceptance target.

The target: a 70B model planned in under 30 s on the 2-core machine, the command's peak RSS
under 2 GB. Each run is a fresh process of a real command, for two models:

* Llama-3-70B from its transformers config class (``--hf llama`` and its config fields, no
  download), at its 8,192-token context:

      python -m fsdp_guide estimate --hf llama --hf-arg hidden_size=8192 ...
          --world-size 64 --seq-len 8192 --activation-checkpointing --gpu-memory 80GB

* the demo transformer at Llama-2-70B's widths (``--model planner_70b:gpt``).

Each builds the model on the meta device, traces one forward and backward on fake tensors
and plans every strategy of the catalog. Wall time includes the interpreter and the imports
(torch, and transformers for the first); peak RSS is the child's ``ru_maxrss``.

Usage::

    python benchmarks/planner_70b.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_guide.models import TinyTransformer, TransformerConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "planner_70b.md"
# Llama-2-70B's widths on the demo transformer (no grouped-query attention, GELU MLP).
CONFIG = {"vocab_size": 32000, "dim": 8192, "n_heads": 64, "n_layers": 86, "seq_len": 4096}
# Llama-3-70B's config (grouped-query attention: 8 key/value heads for 64 query heads).
LLAMA3_70B = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
}
TARGET_S, TARGET_RSS = 30.0, 2 * 1024**3


def gpt(**sizes: int) -> TinyTransformer:
    """The demo transformer at the sizes ``--model-arg`` gives."""
    return TinyTransformer(TransformerConfig(**sizes))


def command(model: str) -> list[str]:
    """The command for ``"hf"`` (Llama-3-70B's config) or ``"demo"`` (the demo transformer)."""
    args = [sys.executable, "-m", "fsdp_guide", "estimate"]
    if model == "hf":
        args += [
            "--hf",
            "llama",
            *(a for k, v in LLAMA3_70B.items() for a in ("--hf-arg", f"{k}={v}")),
        ]
        args += ["--seq-len", "8192"]
    else:
        args += ["--model", "planner_70b:gpt"]
        args += [a for k, v in CONFIG.items() for a in ("--model-arg", f"{k}={v}")]
    return [*args, "--world-size", "64", "--activation-checkpointing", "--gpu-memory", "80GB"]


def run_once(model: str) -> tuple[float, int, str]:
    """Seconds, peak RSS in bytes, and the output of one fresh run of the command."""
    start = time.perf_counter()
    with subprocess.Popen(
        command(model),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")},  # for planner_70b:gpt
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        output = proc.stdout.read()
        # wait4 gives this child's own resource usage, its peak RSS among it.
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"the command failed:\n{output}")
    scale = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    return seconds, usage.ru_maxrss * scale, output


def section(title: str, model: str, repeats: int) -> tuple[list[str], bool]:
    """A results section for one model, and whether it met both targets."""
    runs = [run_once(model) for _ in range(repeats)]
    seconds = [r[0] for r in runs]
    peaks = [r[1] for r in runs]
    met = max(seconds) < TARGET_S and max(peaks) < TARGET_RSS
    lines = [
        f"## {title}",
        "",
        f"`{' '.join(['python', *command(model)[1:]])}`",
        "",
        "| | median | max | target |",
        "| --- | ---: | ---: | ---: |",
        f"| wall time (s) | {statistics.median(seconds):.1f} | {max(seconds):.1f} "
        f"| < {TARGET_S:.0f} |",
        f"| peak RSS (MB) | {statistics.median(peaks) / 2**20:.0f} | {max(peaks) / 2**20:.0f} "
        f"| < {TARGET_RSS / 2**20:.0f} |",
        "",
        f"Target met: {met}. The command's output:",
        "",
        "```text",
        runs[-1][2].rstrip(),
        "```",
        "",
    ]
    return lines, met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    hf, hf_met = section("Llama-3-70B from its config (`--hf llama`)", "hf", args.repeats)
    demo, demo_met = section("The demo transformer at Llama-2-70B's widths", "demo", args.repeats)
    out = [
        "# Planning a 70B-parameter model: time and peak memory",
        "",
        f"{args.repeats} fresh runs of each command on {platform.machine()}, "
        f"{os.cpu_count()} CPU(s), torch {torch.__version__}; the machine was shared with "
        "other jobs. Wall time includes starting Python and the imports; peak RSS is the "
        f"command's. Both targets met: {hf_met and demo_met}. The model in bf16 alone would "
        "be 140 GB: nothing of it is allocated (meta device, fake tensors).",
        "",
        *hf,
        *demo,
    ]
    RESULTS.write_text("\n".join(out).rstrip() + "\n", encoding="utf-8")
    print("\n".join(out))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
