"""consolidate: a sharded checkpoint directory into one full file, in one process (private)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fsdp_guide.checkpoint._dir import open_offline
from fsdp_guide.checkpoint._full import full_payload, write_full
from fsdp_guide.checkpoint._shards import consolidate_state
from fsdp_guide.errors import CheckpointError


def check_target(source: Path, target: Path) -> None:
    """Raise unless ``target`` is a file path that writing cannot harm ``source`` through.

    Refused: a directory, a path under a file, a path inside the source directory (its
    index, a shard, a new file among them), and any path that is one of the source's files
    under another name (a hard or symbolic link).

    Raises:
        ValueError: Naming the problem; nothing was read or written.

    Examples:
        >>> import tempfile
        >>> source = Path(tempfile.mkdtemp())
        >>> check_target(source, source.parent / "full.pt")
        >>> check_target(source, source / "index.json")
        Traceback (most recent call last):
        ...
        ValueError: DST .../index.json is inside the checkpoint SRC ...: writing it would ...
    """
    if target.is_dir():
        raise ValueError(f"DST {target} is a directory; give a file path such as full.pt")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"DST {target} lies under {parent}, which is a file")
            break
    source_real, target_real = source.resolve(), target.resolve()
    if target_real == source_real or source_real in target_real.parents:
        raise ValueError(
            f"DST {target} is inside the checkpoint SRC {source}: writing it would change the "
            "checkpoint being read; write the full file elsewhere, e.g. beside SRC"
        )
    if not target.exists():
        return
    seen = target.stat()
    for root, _, names in os.walk(source):
        for name in names:
            held = Path(root, name)
            if held.exists() and os.path.samestat(held.stat(), seen):
                raise ValueError(
                    f"DST {target} is {held} of the checkpoint SRC under another name (a link): "
                    "writing it would change the checkpoint; write the full file elsewhere"
                )


def consolidate(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> dict[str, Any]:
    """Turn a sharded checkpoint directory into a full checkpoint file, in one process.

    Needs neither the model code nor a process group, and loads every shard in this
    process (enough host memory for the whole state is needed). Every field of the index
    and every file's SHA-256 are checked first; the full file written carries the SHA-256 of
    its own contents, like one that ``save(kind="full")`` writes. A ``target`` inside the
    source directory, or one of its files under another name, is refused before anything
    is written.

    Args:
        source: Directory written by ``save(..., kind="sharded")``.
        target: File to write; it then loads at any world size.

    Returns:
        A summary with ``strategy``, ``world_size``, ``tensors`` and ``bytes`` of the model
        state, and whether an ``optimizer`` state was consolidated (not for FairScale FSDP).

    Raises:
        ValueError: ``target`` is a directory, lies under a file, inside ``source``, or is
            one of its files.
        CheckpointError: The source is not a complete, intact sharded checkpoint, or
            writing failed (a full disk named as such).

    Examples:
        An FSDP2 checkpoint of one rank, consolidated after its process group is gone:

        >>> import tempfile
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> from fsdp_guide.launcher import dist_init, find_free_port
        >>> from fsdp_guide.checkpoint import load, save
        >>> dist_init(0, 1, master_port=find_free_port())
        >>> model = fully_shard(nn.Linear(2, 1), mesh=init_device_mesh("cpu", (1,)))
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = save(root / "sharded", model, kind="sharded", extra={"step": 3})
        >>> dist.destroy_process_group()
        >>> consolidate(root / "sharded", root / "full.pt")
        {'strategy': 'fsdp2', 'world_size': 1, 'tensors': 2, 'bytes': 12, 'optimizer': False}
        >>> load(root / "full.pt", nn.Linear(2, 1))
        {'step': 3}

        A plain module also loads the sharded checkpoint itself:

        >>> layer = nn.Linear(2, 1)
        >>> load(root / "sharded", layer)
        {'step': 3}
        >>> torch.equal(layer.weight, torch.load(root / "full.pt")["model"]["weight"])
        True
    """
    source, target = Path(source), Path(target)
    if not source.is_dir():
        raise CheckpointError(
            f"{source} is not a directory; consolidate takes a sharded checkpoint"
        )
    check_target(source, target)
    opened = open_offline(source)
    index = opened.index
    model_state, optim_state = consolidate_state(source, opened)
    optimizer_class = index["optimizer"]["class"] if index.get("optimizer") else None
    payload = full_payload(
        index["strategy"],
        index["world_size"],
        model_state,
        optim_state,
        optimizer_class,
        opened.extra,
    )
    write_full(target, payload)
    tensors = [v for v in model_state.values() if isinstance(v, torch.Tensor)]
    return {
        "strategy": index["strategy"],
        "world_size": index["world_size"],
        "tensors": len(tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "optimizer": optim_state is not None,
    }
