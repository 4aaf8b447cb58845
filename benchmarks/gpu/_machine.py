"""The machine the steps run on: GPU, driver, torch, CUDA and package versions."""

from __future__ import annotations

import datetime
import subprocess
import sys
from typing import Any

from ._output import output_tail, parse_data, print_table
from ._paths import SCRIPT
from ._runner import child_env

# Distribution names whose versions the report gives.
PACKAGES = (
    "torch",
    "pytorch-lightning",
    "fairscale",
    "deepspeed",
    "numpy",
    "nbclient",
    "ipykernel",
    "pytest",
)


def parse_nvidia_smi(output: str) -> dict[str, str]:
    """Name, driver and memory of the first GPU from ``nvidia-smi --query-gpu=... csv``.

    Examples:
        >>> parse_nvidia_smi("NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB\\n")
        {'gpu': 'NVIDIA H100 80GB HBM3', 'driver': '580.159.04', 'gpu_memory': '81559 MiB'}
    """
    for line in output.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3 and all(fields):
            return {"gpu": fields[0], "driver": fields[1], "gpu_memory": fields[2]}
    return {}


def collect_environment(timeout: float = 120.0) -> dict[str, Any]:
    """Device, driver and versions: ``nvidia-smi``, and the script's ``--internal env``.

    The versions come from a subprocess (:func:`probe`) with a time limit, so that the
    runner itself imports only the standard library and a torch that hangs stops nothing.
    """
    env: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    }
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        smi = subprocess.run(query, capture_output=True, text=True, timeout=60, check=False)
        env.update(parse_nvidia_smi(smi.stdout))
    except (OSError, subprocess.TimeoutExpired) as exc:
        env["nvidia_smi_error"] = repr(exc)
    command = [sys.executable, str(SCRIPT), "--internal", "env"]
    try:
        out = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=child_env(), check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        env["probe_error"] = repr(exc)
        return env
    values = parse_data(out.stdout).get("environment", [])
    if values:
        env.update(values[0])
    else:
        env["probe_error"] = output_tail(out.stdout + out.stderr, lines=10)
    return env


def probe() -> int:
    """Print the versions and the device torch sees, as an ``environment`` table."""
    import platform
    from importlib import metadata

    info: dict[str, Any] = {"python": platform.python_version()}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda)
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(device=props.name, device_count=torch.cuda.device_count())
            info["capability"] = f"{props.major}.{props.minor}"
            info["cudnn"] = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
            info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
    except Exception as exc:  # reported, not raised: the report needs the rest
        info["torch_error"] = repr(exc)
    packages: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    info["packages"] = packages
    print_table("environment", [info])
    return 0
