"""Train a small transformer with PyTorch FSDP2, save a sharded checkpoint, resume from it.

Plain PyTorch, nothing from fsdp-guide: copy it into your project. Run it on 2 ranks with::

    torchrun --nproc_per_node 2 examples/fsdp2_train.py --steps 4 --checkpoint-dir /tmp/ckpt
    torchrun --nproc_per_node 2 examples/fsdp2_train.py --steps 8 \
        --checkpoint-dir /tmp/ckpt --resume

Each save goes to its own ``step-N`` directory under ``--checkpoint-dir``; ``--resume`` loads
the latest one.

On a machine with a GPU per rank it uses NCCL and the GPUs; otherwise gloo and the CPU. To
fine-tune a Hugging Face model (pretrained weights loaded into the shards, every block
checkpointed, gradient accumulation), start from ``examples/recipes/fsdp2_finetune.py``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 256, 64, 4, 4, 32, 8


class Model(nn.Module):
    """Token embedding, a stack of transformer blocks, a head: FSDP2 shards each block."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, HEADS, 4 * DIM, dropout=0.0, batch_first=True)
            for _ in range(LAYERS)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return nn.functional.log_softmax(self.head(x), dim=-1)


def batch(step: int, rank: int, world_size: int, device: torch.device) -> torch.Tensor:
    """This rank's part of the global batch of ``step``: the same data on every run."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    per_rank = BATCH // world_size
    return tokens[rank * per_rank : (rank + 1) * per_rank].to(device)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    log_probs = model(tokens[:, :-1]).float()
    return nn.functional.nll_loss(log_probs.flatten(0, 1), tokens[:, 1:].flatten())


def latest(checkpoint_dir: str) -> Path:
    """The ``step-N`` directory with the largest N."""
    saved = sorted(Path(checkpoint_dir).glob("step-*"), key=lambda p: int(p.name[5:]))
    if not saved:
        raise FileNotFoundError(f"no step-N checkpoint in {checkpoint_dir}")
    return saved[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="train until this step")
    parser.add_argument("--checkpoint-dir", default=None, help="save a sharded checkpoint here")
    parser.add_argument("--resume", action="store_true", help="load --checkpoint-dir first")
    args = parser.parse_args()

    # 1. Process group: torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT.
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ["LOCAL_WORLD_SIZE"]
    )
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    # 2. The same model on every rank (same seed), then a 1-D device mesh over all ranks.
    torch.manual_seed(0)
    model = Model().to(device)
    mesh = init_device_mesh(device.type, (world_size,))

    # 3. Shard each block, then the root (which keeps embedding and head). Parameters are
    # gathered in bf16 for compute; gradients are reduced and the optimizer steps in fp32.
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mixed)
    fully_shard(model, mesh=mesh, mp_policy=mixed)

    # 4. The optimizer AFTER sharding: fully_shard replaced the parameters with DTensor shards.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # 5. Resume: every rank reads its own shards (at any world size); DCP reshards them.
    start = 0
    if args.resume:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=latest(args.checkpoint_dir))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        start = int(state["step"])

    for step in range(start, args.steps):
        loss = loss_of(model, batch(step, rank, world_size, device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step + 1}: loss {mean.item() / world_size:.6f}", flush=True)

    # 6. Save: a collective; each rank writes only its shards.
    if args.checkpoint_dir:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": torch.tensor(args.steps)}
        target = Path(args.checkpoint_dir) / f"step-{args.steps}"
        dcp.save(state, checkpoint_id=target)
        if rank == 0:
            print(f"saved step {args.steps} to {target}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
