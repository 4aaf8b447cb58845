"""Run the main job, ``python -m fsdp_guide compare``, and commit its output for the docs.

The CLI page of the site shows this run (a run on a 2-core CPU machine; step times vary from
machine to machine, the bytes do not). Run from the repository root::

    python benchmarks/cli_compare.py
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import torch

OUT = Path("benchmarks/results/cli_compare.md")
COMMAND = [sys.executable, "-m", "fsdp_guide", "compare"]


def main() -> None:
    done = subprocess.run(COMMAND, capture_output=True, text=True, check=True, timeout=600)
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    OUT.write_text(
        "# The main job: `python -m fsdp_guide compare`\n\n"
        f"Output of one run ({machine}):\n\n"
        f"```console\n$ python -m fsdp_guide compare\n{done.stdout.rstrip()}\n```\n",
        encoding="utf-8",
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
