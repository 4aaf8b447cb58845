"""``examples/recipes/slurm_finetune.sbatch`` parses and, under SLURM's environment, runs each
recipe the right way on every node (``scontrol`` and ``srun`` stubbed, see ``slurm_stubs``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from recipe_runs import RECIPES, recipe
from slurm_stubs import run_batch_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "recipes" / "slurm_finetune.sbatch"


def test_the_batch_script_is_valid_bash() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_sbatch_header_asks_for_one_task_per_node() -> None:
    header = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", SCRIPT.read_text(), re.MULTILINE))
    assert header["ntasks-per-node"] == "1" and header["gpus-per-node"] == "8"


@pytest.mark.parametrize(
    ("engine", "extra_env", "head", "nproc", "args"),
    [
        ("fsdp2", {}, "gpu-017", "8", ["--model", "/m/llama-70b", "--gpus-per-node", "8"]),
        ("deepspeed_zero3", {}, "gpu-017", "8", ["--model", "/m/llama-8b", "--offload-optimizer"]),
        (
            "ddp",
            {"SLURM_JOB_NODELIST": "cpu[9,12-13]", "SLURM_JOB_NUM_NODES": "3"}
            | {"NPROC_PER_NODE": "2", "SAVE_EVERY": "5", "MAX_RESTARTS": "1"},
            "cpu9",
            "2",
            ["--steps", "20"],
        ),  # CPU nodes: the ranks per node given
    ],
)
def test_under_slurm_each_node_runs_torchrun_on_the_recipe_with_a_fresh_store_per_start(
    tmp_path: Path, engine: str, extra_env: dict[str, str], head: str, nproc: str, args: list[str]
) -> None:
    name = f"{RECIPES[engine]}.py"
    command, env = run_batch_script(SCRIPT, tmp_path, extra_env, args=[name, *args], cwd=ROOT)
    save_every = extra_env.get("SAVE_EVERY", "100")
    assert command == [
        "--kill-on-bad-exit=1", "torchrun",
        "--nnodes", extra_env.get("SLURM_JOB_NUM_NODES", "2"),
        "--nproc-per-node", nproc,
        "--rdzv-id", "81234",
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{head}:29400",
        "--max-restarts", extra_env.get("MAX_RESTARTS", "3"),
        f"examples/recipes/{name}",
        "--checkpoint-dir", f"{tmp_path}/checkpoints/fsdp2", "--save-every", save_every,
        *args,
    ]  # fmt: skip
    # Restarts need it (the recipes refuse --max-restarts without it), on every node.
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    parsed = recipe(engine).parse_args(command[command.index(f"examples/recipes/{name}") + 1 :])
    assert parsed.checkpoint_dir == f"{tmp_path}/checkpoints/fsdp2"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "name a recipe"),
        (["fsdp3_finetune.py"], "no recipe examples/recipes/fsdp3_finetune.py here"),
    ],
)
def test_without_a_known_recipe_the_script_stops_before_srun(
    tmp_path: Path, args: list[str], message: str
) -> None:
    with pytest.raises(AssertionError, match=message):
        run_batch_script(SCRIPT, tmp_path, {}, args=args, cwd=ROOT)
    assert not (tmp_path / "srun.json").exists()
