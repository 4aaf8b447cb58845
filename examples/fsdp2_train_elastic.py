"""Train with FSDP2 so that a restart resumes: a sharded checkpoint every few steps, loaded first.

The same model, data and sharding as ``fsdp2_train.py`` (so the same losses), written as a
``launch`` training function. Under ``torchrun --max-restarts N``, when a rank dies (killed, out
of memory, its node lost) torchrun stops the other ranks and starts them all again, up to N
times; each start loads the latest complete checkpoint and carries on from its step. The steps
since that checkpoint are trained again, so ``--save-every`` trades the time a save takes
against the steps a restart redoes. A save interrupted halfway is never loaded:
``fsdp_guide.checkpoint.save`` publishes a checkpoint only once every rank has written its
shards, and until then the directory still describes the previous one.

On two nodes (the same command on each; HOST is the first node), with a directory every node
can read and write::

    torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 examples/fsdp2_train_elastic.py \\
        --steps 100 --save-every 10 --checkpoint-dir /shared/ckpt

On one machine: ``python examples/fsdp2_train_elastic.py --checkpoint-dir /tmp/ckpt``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp2_train import Model, batch, loss_of  # the plain script, beside this one
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_guide import checkpoint, launch
from fsdp_guide.launcher import rank_device
from fsdp_guide.wrap import LayerPolicy, shard


def train(
    rank: int, world_size: int, steps: int, save_every: int, checkpoint_dir: str
) -> list[float]:
    """Train until ``steps``, saving every ``save_every`` steps; start from the last save."""
    device = rank_device()
    torch.manual_seed(0)
    model = Model().to(device)
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = LayerPolicy(nn.TransformerEncoderLayer)  # one FSDP unit per block, then the root
    model = shard(model, engine="fsdp2", policy=policy, mp_policy=mixed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    start = 0
    # index.json is written last, once every rank's shards are on disk: it exists as soon as
    # one save has completed, and always names a complete checkpoint.
    if (Path(checkpoint_dir) / "index.json").exists():
        extra = checkpoint.load(checkpoint_dir, model, optimizer)  # every rank calls it
        start = int(extra["step"]) if extra else 0
    if rank == 0:
        # torchrun counts the restarts of the group on this node (0 on the first start).
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(f"start {restarts}: from step {start}", flush=True)

    losses = []
    for step in range(start, steps):
        loss = loss_of(model, batch(step, rank, world_size, device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
        if rank == 0:
            print(f"step {step + 1}: loss {losses[-1]:.6f}", flush=True)
        if (step + 1) % save_every == 0 or step + 1 == steps:
            checkpoint.save(
                checkpoint_dir, model, optimizer, kind="sharded", extra={"step": step + 1}
            )
            if rank == 0:
                print(f"saved step {step + 1}", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--world-size", type=int, default=2, help="ranks (ignored under torchrun)")
    args = parser.parse_args()
    launch(
        train,
        world_size=args.world_size,
        args=(args.steps, args.save_every, args.checkpoint_dir),
    )


if __name__ == "__main__":
    main()
