"""The FSDP2 script readers copy (examples/) runs under torchrun on 2 CPU ranks, resumes
exactly, and the fsdp-guide version of it trains to the same losses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_guide.launcher import find_free_port

ROOT = Path(__file__).resolve().parents[2]
PLAIN = ROOT / "examples" / "fsdp2_train.py"
HELPERS = ROOT / "examples" / "fsdp2_train_fsdp_guide.py"
LOSS = re.compile(r"step (\d+): loss ([0-9.]+)")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run(*command: str) -> dict[int, str]:
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return {int(step): loss for step, loss in LOSS.findall(done.stdout)}


def torchrun(*args: str) -> dict[int, str]:
    port = str(find_free_port())
    return run(
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", port, str(PLAIN), *args,
    )  # fmt: skip


def test_plain_fsdp2_script_resumes_exactly_and_matches_the_helper_version(tmp_path: Path) -> None:
    straight = torchrun("--steps", "4")
    assert sorted(straight) == [1, 2, 3, 4]
    first = torchrun("--steps", "2", "--checkpoint-dir", str(tmp_path))
    resumed = torchrun("--steps", "4", "--checkpoint-dir", str(tmp_path), "--resume")
    assert (tmp_path / "step-2").is_dir() and (tmp_path / "step-4").is_dir()
    assert {**first, **resumed} == straight  # the losses after resuming, digit for digit

    helpers = run(sys.executable, str(HELPERS), "--steps", "4", "--world-size", "2")
    assert helpers == straight
