"""Where the repository, its notebooks, the script and the default outputs are."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The command line; the steps other than pytest run it again with ``--internal``.
SCRIPT = REPO / "benchmarks" / "gpu_validation.py"
NOTEBOOKS = REPO / "notebooks"
DEFAULT_RESULTS = REPO / "benchmarks" / "results" / "gpu_validation.md"
DEFAULT_WORK_DIR = REPO / "benchmarks" / "out" / "gpu_validation"
