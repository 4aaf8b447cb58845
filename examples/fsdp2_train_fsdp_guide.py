"""The same training as ``fsdp2_train.py``, with fsdp-guide's helpers doing the plumbing.

Same model, data, sharding and optimizer, so the same losses. What the helpers replace:
``launch`` starts the ranks itself (or joins ``torchrun``'s), ``shard`` applies
``fully_shard`` per block and on the root from a policy, ``check_optimizer`` catches an
optimizer built before sharding, ``checkpoint.save``/``load`` write and read a sharded
checkpoint atomically (loadable at another world size), and ``measure_model_state`` says
what each rank holds. Run it with plain Python (2 ranks by default) or under ``torchrun``::

    python examples/fsdp2_train_fsdp_guide.py --steps 4 --checkpoint-dir /tmp/ckpt-guide
    torchrun --nproc_per_node 2 examples/fsdp2_train_fsdp_guide.py --steps 4
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from fsdp2_train import Model, batch, loss_of  # the plain script, beside this one
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_guide import checkpoint, launch
from fsdp_guide.launcher import rank_device
from fsdp_guide.memory import measure_model_state
from fsdp_guide.wrap import LayerPolicy, check_optimizer, shard


def train(rank: int, world_size: int, steps: int, checkpoint_dir: str | None, resume: bool) -> None:
    device = rank_device()  # this rank's GPU under NCCL, the CPU under gloo
    torch.manual_seed(0)
    model = Model().to(device)
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = LayerPolicy(nn.TransformerEncoderLayer)  # one FSDP unit per block, then the root
    model = shard(model, engine="fsdp2", policy=policy, mp_policy=mixed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    check_optimizer(model, optimizer)

    start = 0
    if resume and checkpoint_dir:
        extra = checkpoint.load(checkpoint_dir, model, optimizer)  # every rank calls it
        start = int(extra["step"]) if extra else 0
    for step in range(start, steps):
        loss = loss_of(model, batch(step, rank, world_size, device))
        loss.backward()
        optimizer.step()
        if step == steps - 1:
            held = measure_model_state(model, optimizer)
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step + 1}: loss {mean.item() / world_size:.6f}", flush=True)
    if start < steps:
        print(f"rank {rank} holds {held.total:,} bytes of model state", flush=True)
    if checkpoint_dir:
        checkpoint.save(checkpoint_dir, model, optimizer, kind="sharded", extra={"step": steps})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2, help="ranks (ignored under torchrun)")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    launch(
        train,
        world_size=args.world_size,
        args=(args.steps, args.checkpoint_dir, args.resume),
    )


if __name__ == "__main__":
    main()
