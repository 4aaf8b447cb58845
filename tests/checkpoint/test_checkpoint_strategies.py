"""Save, load into a fresh model and optimizer, and resume, for every strategy on 2 gloo ranks.

The rank function, :func:`checkpoint_helpers.save_load_resume`, lives in a helper module so that
spawned (CUDA) ranks can import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import save_load_resume

from fsdp_guide import launch

WORLD = 2


CASES = [
    ("module", "full"),
    ("ddp", "full"),
    ("zero1", "full"),
    ("oss", "full"),
    ("sharded_ddp", "full"),
    ("fsdp1", "full"),
    ("fsdp1", "sharded"),
    ("fsdp2", "full"),
    ("fsdp2", "sharded"),
]


def check(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["fresh_differed"], "the fresh model must start from other weights"
        assert result["differences"] == [], f"rank {rank}: not bit-equal after load"
        assert result["extra_ok"]
        assert result["resumed"] == result["uninterrupted"]
    # Rank 0 holds the (consolidated) optimizer state: params + Adam's 3 tensors per param.
    assert results[0]["optimizer_tensors"] > 0


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("strategy", "kind"), CASES, ids=[f"{s}-{k}" for s, k in CASES])
def test_save_load_resume_on_two_ranks(tmp_path: Path, strategy: str, kind: str) -> None:
    path = tmp_path / ("ckpt" if kind == "sharded" else "ckpt.pt")
    results = launch(
        save_load_resume,
        world_size=WORLD,
        args=(strategy, kind, str(path)),
        backend="gloo",
        start_method="fork",
        timeout=150,
    )
    check(results)
    assert path.is_dir() == (kind == "sharded")


@pytest.mark.timeout(60)
def test_save_load_resume_plain_module_single_process(tmp_path: Path) -> None:
    result = save_load_resume(0, 1, "module", "full", str(tmp_path / "ckpt.pt"))
    check([result])


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_save_load_resume_fairscale_fsdp(tmp_path: Path, kind: str) -> None:
    # FairScale FSDP runs on CUDA only; one GPU is world size 1 on NCCL.
    path = tmp_path / ("ckpt" if kind == "sharded" else "ckpt.pt")
    world = min(torch.cuda.device_count(), WORLD)
    results = launch(
        save_load_resume,
        world_size=world,
        args=("fairscale_fsdp", kind, str(path)),
        backend="nccl",
        start_method="spawn",
        timeout=250,
    )
    check(results)
