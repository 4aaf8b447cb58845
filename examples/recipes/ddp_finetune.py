"""Fine-tune a Hugging Face causal language model with PyTorch DDP: for models that fit replicated.

Plain PyTorch and transformers, nothing from fsdp-guide: copy this file into your project.
Each rank holds the whole model, its gradients and AdamW's state; use it when ``python -m
fsdp_guide estimate`` says ``ddp`` fits, since it sends the least and is the simplest. What it
does, in order:

1. The model is built from its config on the ``meta`` device and materialised once, on the
   rank's device (no throw-away random copy first).
2. Pretrained weights (a ``.safetensors`` file, or a Hugging Face directory of them) are read
   by rank 0 alone, one file at a time, and broadcast to every rank
   (``set_model_state_dict(..., broadcast_from_rank0=True)``).
3. Every decoder block is checkpointed (its activations recomputed in backward).
4. Each optimizer step accumulates ``--grad-accum`` micro-batches under ``no_sync()`` (one
   gradient all-reduce per step, on the last one), clips the gradient norm and steps AdamW;
   bf16 autocast on GPUs, fp32 on CPU.
5. A checkpoint (``torch.distributed.checkpoint``) every ``--save-every`` steps; a start finds
   the latest complete one and resumes from it, so ``torchrun --max-restarts`` restarts carry
   on where the job stopped.

One GPU, eight GPUs of one node, four nodes of eight::

    torchrun --nproc-per-node 1 ddp_finetune.py --model /models/Llama-3.2-1B
    torchrun --nproc-per-node 8 ddp_finetune.py --model /models/Llama-3.2-1B \\
        --data train.bin --data-dtype uint32 --seq-len 4096 --micro-batch 1 --grad-accum 8
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        --max-restarts 3 ddp_finetune.py --model /models/Llama-3.2-1B ...

Without ``--model`` it fine-tunes a tiny Llama-shaped model on a synthetic token stream, on CPU
with gloo where there is no GPU: ``torchrun --nproc-per-node 2 ddp_finetune.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model = p.add_argument_group("model and data")
    model.add_argument("--model", help="a Hugging Face model directory: config.json, *.safetensors")
    model.add_argument("--hf-config", help="a config.json (or a directory with one): random init")
    model.add_argument("--weights", help="a .safetensors file or a directory of them to load")
    model.add_argument("--data", help="token ids, one flat binary file (default: synthetic)")
    model.add_argument("--data-dtype", choices=("uint16", "uint32"), default="uint16")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=positive, default=20, help="train until this step")
    train.add_argument("--seq-len", type=positive, default=64, help="tokens per sequence")
    train.add_argument(
        "--micro-batch", type=positive, default=2, help="sequences a rank runs at once"
    )
    train.add_argument("--grad-accum", type=positive, default=1, help="micro-batches per step")
    train.add_argument("--lr", type=float, default=3e-4, help="peak learning rate of AdamW")
    train.add_argument("--warmup-steps", type=int, default=0)
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global norm")
    train.add_argument("--seed", type=int, default=0, help="the data order and a random init")
    train.add_argument(
        "--precision", choices=("bf16", "fp32"), default="bf16", help="on GPUs (CPUs: fp32)"
    )
    train.add_argument(
        "--no-activation-checkpointing", dest="activation_checkpointing", action="store_false"
    )
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", help="save here, and resume from here")
    ckpt.add_argument("--save-every", type=positive, default=100, help="steps between saves")
    return p.parse_args(argv)


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


# ---------------------------------------------------------------------------- model and weights


# ---------------------------------------------------------------------------- model and weights


def model_config(args: argparse.Namespace) -> Any:
    """The model's config: from ``--model``/``--hf-config``, else a tiny Llama-shaped one."""
    from transformers import AutoConfig, LlamaConfig

    if args.model or args.hf_config:
        return AutoConfig.from_pretrained(args.hf_config or args.model)
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (decoder layers) that transformers never splits across devices."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no blocks in _no_split_modules")
    return blocks


def build_model(args: argparse.Namespace, config: Any, device: torch.device) -> nn.Module:
    """The model built on the meta device, then materialised on ``device`` (fp32 weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if args.activation_checkpointing:  # keep each block's input only; recompute the rest
        for block in blocks_of(model):
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    model.to_empty(device=device)
    # init_weights fills the weights (and the rotary buffers, which are in no checkpoint)
    # before the pretrained weights, if any, overwrite them.
    torch.manual_seed(args.seed)
    with torch.no_grad():
        model.init_weights()
    return model


def weight_files(path: str) -> list[Path]:
    """A ``.safetensors`` file, or every one in a directory (a sharded Hugging Face save)."""
    where = Path(path)
    files = sorted(where.glob("*.safetensors")) if where.is_dir() else [where]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no .safetensors weights at {where}")
    return files


def load_weights(model: nn.Module, path: str) -> None:
    """Rank 0 reads the files one at a time; each tensor is broadcast to every rank.

    Rank 0 never holds more than one file on top of the model.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    expected = set(model.state_dict())
    # A tied weight (a head sharing the embedding) is saved once, under one of its names.
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {
        n for n, _ in model.named_parameters()
    }
    info: list[Any] = [None, None]
    if dist.get_rank() == 0:
        files = weight_files(path)
        found: set[str] = set()
        for f in files:
            with safe_open(f, framework="pt") as opened:
                found.update(opened.keys())
        info = [files, sorted(expected - tied - found)]
    dist.broadcast_object_list(info, src=0)  # every rank learns the files and what is missing
    files, missing = info
    if missing:  # raised on every rank at once: no rank is left waiting in a broadcast
        raise ValueError(f"{path} lacks {len(missing)} weights of the model, e.g. {missing[:3]}")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    for f in files:
        part = load_file(f) if dist.get_rank() == 0 else {}
        set_model_state_dict(model, part, options=options)
        del part


# -------------------------------------------------------------------------------------- data


def token_stream(args: argparse.Namespace, vocab_size: int) -> torch.Tensor:
    """The training tokens: ``--data`` (token ids in a flat binary file), or a synthetic stream.

    The synthetic stream can be learnt: each token is followed by one of two tokens, so the
    loss falls from ln(vocab) towards ln(2).
    """
    if args.data:
        if args.data_dtype == "uint16" and vocab_size > 2**16:
            raise ValueError(f"token ids up to {vocab_size - 1} need --data-dtype uint32")
        dtype = {"uint16": torch.uint16, "uint32": torch.uint32}[args.data_dtype]
        size = os.path.getsize(args.data) // dtype.itemsize
        return torch.from_file(args.data, shared=False, size=size, dtype=dtype)
    coins = torch.randint(0, 2, (100_000,), generator=torch.Generator().manual_seed(1234))
    tokens = [0]
    for coin in coins.tolist():
        tokens.append((tokens[-1] * 5 + 1 + coin * 7) % vocab_size)
    return torch.tensor(tokens)


@functools.lru_cache(maxsize=2)
def shuffled(count: int, seed: int) -> torch.Tensor:
    """One epoch's order of the ``count`` sequences."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed))


def micro_batches(
    tokens: torch.Tensor, step: int, args: argparse.Namespace, rank: int, world_size: int
) -> list[torch.Tensor]:
    """This rank's micro-batches of optimizer step ``step``: ``grad_accum`` of ``micro_batch``.

    Step ``step`` trains on sequences ``step * G`` to ``(step + 1) * G - 1`` of a shuffled
    order (``G`` = micro-batch x accumulation x ranks), the same at any world size, so a
    resumed run sees the data it would have seen and 1 rank can replay 8.
    """
    count = (len(tokens) - 1) // args.seq_len
    per_rank = args.micro_batch * args.grad_accum
    first = step * per_rank * world_size + rank * per_rank
    rows = []
    for i in range(first, first + per_rank):
        epoch, position = divmod(i, count)
        start = int(shuffled(count, args.seed + epoch)[position]) * args.seq_len
        rows.append(tokens[start : start + args.seq_len + 1].long())
    return list(torch.stack(rows).split(args.micro_batch))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the micro-batch."""
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of ``--lr`` at ``--steps``."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


# ------------------------------------------------------------------------------- checkpoints


def latest_checkpoint(directory: str | None) -> Path | None:
    """The newest complete ``step-N`` save: DCP writes ``.metadata`` once every rank is done."""
    if directory is None:
        return None
    done = [p for p in Path(directory).glob("step-*") if (p / ".metadata").exists()]
    return max(done, key=lambda p: int(p.name.removeprefix("step-")), default=None)


def save_checkpoint(directory: str, step: int, model: nn.Module, optimizer: Any) -> None:
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(step)}
    dcp.save(state, checkpoint_id=Path(directory) / f"step-{step}")  # each tensor once


def load_checkpoint(path: Path, model: nn.Module, optimizer: Any) -> int:
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(state["step"])


# ---------------------------------------------------------------------------------- training


def check_restartable() -> None:
    """Refuse ``torchrun --max-restarts`` while the ranks share the agent's store.

    torchrun's agent serves the ranks' store and keeps it across restarts; a restarted rank
    can read the previous start's addresses there and fail to connect, or hang
    (pytorch/pytorch#135712). With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's
    environment every start gets a store of its own.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RuntimeError(
            "torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its "
            "environment, or restarted ranks may connect to the previous start's addresses"
        )


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Train; return rank 0's log (one dict a step), printed as it goes."""
    args = parse_args(argv)
    check_restartable()
    started_here = not dist.is_initialized()
    if started_here:  # torchrun set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        if torch.cuda.is_available():  # one GPU per rank, chosen before NCCL starts
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    config = model_config(args)
    model = build_model(args, config, device)
    if args.model or args.weights:
        load_weights(model, args.weights or args.model)
    # DDP broadcasts rank 0's parameters and buffers once more here, then all-reduces the
    # gradients in buckets during backward.
    model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [  # no weight decay on norms and biases
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    bf16 = device.type == "cuda" and args.precision != "fp32"

    start = 0
    if (resume := latest_checkpoint(args.checkpoint_dir)) is not None:
        start = load_checkpoint(resume, model, optimizer)
        if rank == 0:
            print(f"resumed from step {start} ({resume})", flush=True)
    tokens = token_stream(args, config.vocab_size)
    log = []
    for step in range(start, args.steps):
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        batches = micro_batches(tokens, step, args, rank, world_size)
        total = torch.zeros((), device=device)
        for i, batch in enumerate(batches):
            # Gradients add up locally; the all-reduce runs in the last micro-batch's backward.
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = loss_of(model, batch.to(device)) / len(batches)
                loss.backward()
            total += loss.detach()
        # Every rank holds the same all-reduced gradients: the local norm is the global one.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)  # the mean over ranks (gloo has no AVG)
        entry = {
            "step": step + 1,
            "loss": total.item() / world_size,
            "grad_norm": norm.item(),
            "lr": lr_at(step, args),
            "seconds": time.perf_counter() - began,
        }
        log.append(entry)
        if rank == 0:
            tokens_per_s = args.micro_batch * args.grad_accum * args.seq_len * world_size
            tokens_per_s /= entry["seconds"]
            print(
                f"step {step + 1}: loss {entry['loss']:.6f} grad-norm {entry['grad_norm']:.6f} "
                f"lr {entry['lr']:.3g} tokens/s {tokens_per_s:,.0f}",
                flush=True,
            )
        if args.checkpoint_dir and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            save_checkpoint(args.checkpoint_dir, step + 1, model, optimizer)
            if rank == 0:
                print(f"saved step {step + 1}", flush=True)
    if device.type == "cuda" and rank == 0:
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
    if started_here:
        del model, optimizer  # before their process group goes: freeing them later can hang
        dist.destroy_process_group()
    return log


if __name__ == "__main__":
    main()
