"""``examples/slurm_fsdp2.sbatch`` parses, and under SLURM's environment runs the right command.

The batch script runs here with the variables SLURM sets in a batch step of a two-node
allocation, and with ``scontrol`` and ``srun`` replaced on ``PATH`` by stubs: ``scontrol``
expands the node list as SLURM does, ``srun`` records its arguments. The recorded command is
the one a cluster would run on every node.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm_fsdp2.sbatch"

SCONTROL = """\
#!{python}
# `scontrol show hostnames LIST`: one host per line, ranges like gpu-[017-018,020] expanded.
import re, sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
for part in re.findall(r"[^,\\[]+(?:\\[[^\\]]*\\])?", sys.argv[3]):
    stem, _, ranges = part.partition("[")
    if not ranges:
        print(stem)
        continue
    for item in ranges.rstrip("]").split(","):
        first, _, last = item.partition("-")
        for n in range(int(first), int(last or first) + 1):
            print(f"{{stem}}{{n:0{{len(first)}}d}}")
"""
SRUN = """\
#!{python}
import json, os, sys
with open(os.environ["SRUN_RECORD"], "w") as f:
    json.dump(sys.argv[1:], f)
"""

# What SLURM sets in the batch step of `sbatch --nodes 2 --gpus-per-node 8` (node list in
# SLURM's compressed form).
SLURM_ENV = {
    "SLURM_JOB_ID": "81234",
    "SLURM_JOB_NAME": "fsdp2",
    "SLURM_JOB_NODELIST": "gpu-[017-018]",
    "SLURM_NODELIST": "gpu-[017-018]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURMD_NODENAME": "gpu-017",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_CPUS_ON_NODE": "32",
}


def run_batch_script(
    tmp_path: Path, extra_env: dict[str, str], unset: tuple[str, ...] = ()
) -> list[str]:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (stubs / name).write_text(text.format(python=sys.executable))
        (stubs / name).chmod(0o755)
    record = tmp_path / "srun.json"
    env = {
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "SRUN_RECORD": str(record),
        "SLURM_SUBMIT_DIR": str(tmp_path),
        **SLURM_ENV,
        **extra_env,
    }
    for name in unset:
        del env[name]
    done = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    command: list[str] = json.loads(record.read_text())
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
