"""The docs build is strict about Python warnings too, not only Sphinx's own.

A deprecated call in an extension printed 92 warnings to stderr while ``sphinx -nW`` still
succeeded. ``docs/_ext/fsdp_strict.py`` makes each Python warning a Sphinx warning, so ``-W``
fails on it; here a two-page project shows both outcomes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXT = Path(__file__).resolve().parents[2] / "docs" / "_ext"


def build(tmp_path: Path, warn: bool) -> subprocess.CompletedProcess[str]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "index.rst").write_text("Title\n=====\n\nText.\n")
    (src / "noisy.py").write_text(
        "import warnings\n\n"
        "def setup(app):\n"
        f"    if {warn}:\n"
        "        app.connect('builder-inited', lambda app: warnings.warn('old API', UserWarning))\n"
        "    return {'parallel_read_safe': True}\n"
    )
    (src / "conf.py").write_text(
        f"import sys\nsys.path[:0] = [{str(EXT)!r}, {str(src)!r}]\n"
        "extensions = ['fsdp_strict', 'noisy']\n"
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-nW",
            "-q",
            "-b",
            "html",
            str(src),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("warn", [True, False])
def test_a_python_warning_fails_the_strict_build(tmp_path: Path, warn: bool) -> None:
    done = build(tmp_path, warn)
    if warn:
        assert done.returncode != 0
        assert "UserWarning: old API" in done.stderr
    else:
        assert done.returncode == 0 and done.stderr == "", done.stderr
