"""``examples/slurm_fsdp2.sbatch`` parses, and under SLURM's environment runs the right command.

The batch script runs here with the variables SLURM sets in a batch step of a two-node
allocation, and with ``scontrol`` and ``srun`` replaced on ``PATH`` by stubs: ``scontrol``
expands the node list as SLURM does, ``srun`` records its arguments. The recorded command is
the one a cluster would run on every node.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import slurm_stubs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm_fsdp2.sbatch"


def run_batch_script(
    tmp_path: Path, extra_env: dict[str, str], unset: tuple[str, ...] = ()
) -> list[str]:
    command, _ = slurm_stubs.run_batch_script(SCRIPT, tmp_path, extra_env, unset)
    return command


def test_the_batch_script_is_valid_bash() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_sbatch_header_asks_for_one_task_per_node() -> None:
    header = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", SCRIPT.read_text(), re.MULTILINE))
    assert header["nodes"] == "2" and header["ntasks-per-node"] == "1"


@pytest.mark.parametrize(
    ("extra_env", "head", "nproc", "steps"),
    [
        ({}, "gpu-017", "8", ["1000", "50"]),  # a rank per GPU that SLURM gave the node
        (
            {"SLURM_JOB_NODELIST": "cpu[9,12-13]", "SLURM_JOB_NUM_NODES": "3"}
            | {"NPROC_PER_NODE": "2", "STEPS": "20", "SAVE_EVERY": "5"},
            "cpu9",
            "2",
            ["20", "5"],
        ),  # CPU nodes: the ranks per node given
    ],
)
def test_under_slurm_it_runs_torchrun_once_per_node_with_the_first_node_as_rendezvous(
    tmp_path: Path, extra_env: dict[str, str], head: str, nproc: str, steps: list[str]
) -> None:
    command = run_batch_script(tmp_path, extra_env)
    assert command == [
        "--kill-on-bad-exit=1", "torchrun",
        "--nnodes", extra_env.get("SLURM_JOB_NUM_NODES", "2"),
        "--nproc-per-node", nproc,
        "--rdzv-id", "81234",
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{head}:29400",
        "--max-restarts", "3",
        "examples/fsdp2_train_elastic.py",
        "--steps", steps[0], "--save-every", steps[1],
        "--checkpoint-dir", f"{tmp_path}/checkpoints/fsdp2",
    ]  # fmt: skip


def test_outside_an_allocation_the_script_stops_before_srun(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="SLURM_JOB_NODELIST: unbound variable"):
        run_batch_script(tmp_path, {}, unset=("SLURM_JOB_NODELIST",))
    assert not (tmp_path / "srun.json").exists()
