"""Run a SLURM batch script here as SLURM would, with ``scontrol`` and ``srun`` stubbed.

The script runs with the variables SLURM sets in the batch step of a two-node allocation, and
with ``scontrol`` and ``srun`` replaced on ``PATH``: ``scontrol`` expands the node list as
SLURM does, ``srun`` records its arguments. The recorded command is the one a cluster would
run on every node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

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
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f)
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
    script: Path,
    tmp_path: Path,
    extra_env: dict[str, str],
    unset: tuple[str, ...] = (),
    args: Sequence[str] = (),
    cwd: Path | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Run ``bash script ARGS`` as SLURM's batch step; what ``srun`` got: argv and environment.

    Raises ``AssertionError`` (with the script's error output) if the script fails.
    """
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
        ["bash", str(script), *args],
        cwd=cwd or tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    recorded = json.loads(record.read_text())
    return recorded["argv"], recorded["env"]
