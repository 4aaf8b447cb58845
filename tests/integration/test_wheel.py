"""The package as a user installs it: a wheel built from the checkout, in a fresh venv.

CI (``.ci/run``) builds the sdist and wheel, checks them and runs ``python -m fsdp_guide
compare`` from the wheel in a venv of its own, then names that build in ``FSDP_GUIDE_DIST``.
This test does the cheap half on every run: build (or take CI's), check the metadata and
contents, install the wheel alone into a new venv (its dependencies borrowed from this
environment), and run the command line from outside the checkout, so nothing but the wheel
can be imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from dist_check import check_dist

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and wheel: CI's (``FSDP_GUIDE_DIST``, built from this checkout just before
    the tests), or built here."""
    if built := os.environ.get("FSDP_GUIDE_DIST"):
        return Path(built)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def test_sdist_and_wheel_metadata_and_contents(dist: Path) -> None:
    assert check_dist(dist) == []


@pytest.mark.slow
def test_the_command_line_runs_from_the_wheel_alone(dist: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    (wheel,) = dist.glob("*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    # torch and the other dependencies come from this environment, after the wheel's own
    # site-packages: a .pth line adds a path but runs none of its .pth files (no editable
    # install of the checkout sneaks in).
    site_packages = next((env_dir / "lib").glob("python*/site-packages"))
    (site_packages / "deps.pth").write_text(
        "\n".join({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}) + "\n"
    )
    run = [str(python), "-m", "fsdp_guide"]
    where = subprocess.run(
        [str(python), "-c", "import fsdp_guide; print(fsdp_guide.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert where.stdout.startswith(str(site_packages)), where.stdout
    estimate = subprocess.run(
        [*run, "estimate", "--params", "7e9", "--world-size", "8", "--gpu-memory", "80GB"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert estimate.returncode == 0, estimate.stderr[-2000:]
    assert "fsdp2" in estimate.stdout and "yes" in estimate.stdout
    helped = subprocess.run(
        [*run, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert all(c in helped.stdout for c in ("compare", "estimate", "consolidate", "demo"))
