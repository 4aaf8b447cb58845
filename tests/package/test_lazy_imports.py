"""Importing the package, any sub-package or the command line imports no optional library."""

from __future__ import annotations

import subprocess
import sys

import pytest

OPTIONAL = (
    "fairscale",
    "deepspeed",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "transformers",
    "matplotlib",
    "IPython",
)
SUB_PACKAGES = (
    "catalog",
    "engines",
    "launcher",
    "memory",
    "comm",
    "wrap",
    "checkpoint",
    "compare",
    "deepspeed",
    "cli",
)
# Top-level modules that reach optional libraries when called (transformers for hf.py).
MODULES = ("inputs", "outputs", "hf", "models")


@pytest.mark.slow
def test_no_optional_library_is_imported_by_the_package() -> None:
    imports = "; ".join(f"import fsdp_guide.{name}" for name in (*SUB_PACKAGES, *MODULES))
    code = (
        f"import sys, fsdp_guide; {imports}; fsdp_guide.cli.build_parser(); "
        f"print(sorted(m for m in {OPTIONAL!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
