"""Saves onto a filesystem too small for them; prints what each raised and what was left.

Run as a script inside a private mount namespace whose small tmpfs is mounted at ``argv[1]``
(see ``tests/checkpoint/test_checkpoint_disk_full.py``): the disk fills for real, the kernel
returns ENOSPC from ``write``. Prints one JSON object.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_guide import RankError, checkpoint, launch


def model_of(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(layers)])  # 257 KiB each


def left_in(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def save_two(rank: int, world_size: int, path: str, layers: int) -> None:
    """A small sharded checkpoint that fits, then a large one that fills the disk (raises)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    small = fully_shard(model_of(1), mesh=mesh)
    checkpoint.save(path, small, kind="sharded", extra={"step": 1})
    large = model_of(layers)
    for layer in large:
        fully_shard(layer, mesh=mesh)
    fully_shard(large, mesh=mesh)
    checkpoint.save(path, large, kind="sharded", extra={"step": 2})  # raises, as user code would


def main(root: Path, layers: int, attempts: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    started = time.monotonic()
    try:
        checkpoint.save(root / "full.pt", model_of(layers))
        out["full"] = {"error": None}
    except checkpoint.CheckpointError as exc:
        out["full"] = {"error": str(exc), "seconds": time.monotonic() - started}
    out["full"]["left"] = left_in(root)
    out["sharded"] = []
    for attempt in range(attempts):
        path = root / f"ckpt{attempt}"
        started = time.monotonic()
        try:
            launch(save_two, 2, args=(str(path), layers), backend="gloo", start_method="fork")
            error = None
        except RankError as exc:
            error = str(exc).splitlines()[0]
        index = json.loads((path / "index.json").read_text())
        out["sharded"].append(
            {
                "error": error,
                "seconds": time.monotonic() - started,
                "named": index["extra"].split("/")[0],
                "left": left_in(path),
                "extra": checkpoint.load(path, model_of(1)),
            }
        )
        shutil.rmtree(path)  # room for the next attempt
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
