"""Fine-tune a Hugging Face causal language model with DeepSpeed ZeRO-3 (or ZeRO-1/2, offload).

Plain PyTorch, transformers and DeepSpeed, nothing from fsdp-guide: copy this file and
``deepspeed_zero3.json`` (DeepSpeed's settings, read from beside this file unless
``--deepspeed-config`` names another) into your project. What it does, in order:

1. The model is built from its config inside ``deepspeed.zero.Init``: each parameter is
   partitioned across the ranks as soon as its module is built, so no rank ever holds the
   whole model (ZeRO-1 and -2 keep whole 16-bit weights on every rank: built on the ``meta``
   device, then materialised once).
2. Pretrained weights (a ``.safetensors`` file, or a Hugging Face directory of them) are read
   by rank 0 alone, one file at a time; each parameter is gathered, written by rank 0 and
   partitioned again (``deepspeed.zero.GatheredParameters(..., modifier_rank=0)``).
3. Every decoder block is checkpointed (its activations recomputed in backward).
4. DeepSpeed accumulates ``gradient_accumulation_steps`` micro-batches (``engine.backward``
   divides each loss by it, ``engine.step`` steps AdamW after the last), clips the global
   gradient norm (``gradient_clipping``); bf16 on GPUs with fp32 master weights, fp32 on CPU.
   ``--offload-optimizer`` keeps AdamW's state and the fp32 master weights in host memory
   (and steps there); ``--offload-params`` the 16-bit parameters too.
5. A DeepSpeed checkpoint every ``--save-every`` steps; a start finds the latest complete one
   and resumes from it, so ``torchrun --max-restarts`` restarts carry on where the job stopped.

Launched by ``torchrun`` or by DeepSpeed's launcher; one GPU, eight GPUs of one node, four
nodes of eight::

    torchrun --nproc-per-node 1 deepspeed_zero3_finetune.py --model /models/Llama-3.2-1B
    deepspeed --num_gpus 8 deepspeed_zero3_finetune.py --model /models/Meta-Llama-3-8B \\
        --data train.bin --data-dtype uint32 --seq-len 4096 --micro-batch 1 --grad-accum 8
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        --max-restarts 3 deepspeed_zero3_finetune.py --model /models/Meta-Llama-3-70B ...

Without ``--model`` it fine-tunes a tiny Llama-shaped model on a synthetic token stream, on CPU
with gloo where there is no GPU: ``torchrun --nproc-per-node 2 deepspeed_zero3_finetune.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

CONFIG = Path(__file__).with_name("deepspeed_zero3.json")


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
    zero = p.add_argument_group("DeepSpeed")
    zero.add_argument("--deepspeed-config", default=str(CONFIG), help="DeepSpeed's JSON config")
    zero.add_argument("--zero-stage", type=int, choices=(1, 2, 3), help="override the config's")
    zero.add_argument("--offload-optimizer", action="store_true", help="AdamW in host memory")
    zero.add_argument("--offload-params", action="store_true", help="ZeRO-3: parameters too")
    # The deepspeed launcher passes --local_rank=N; the environment says the same (LOCAL_RANK).
    zero.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", help="save here, and resume from here")
    ckpt.add_argument("--save-every", type=positive, default=100, help="steps between saves")
    return p.parse_args(argv)


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def deepspeed_config(args: argparse.Namespace, on_gpu: bool) -> dict[str, Any]:
    """The JSON config, with what this script's arguments say written into it."""
    config: dict[str, Any] = json.loads(Path(args.deepspeed_config).read_text())
    zero = config.setdefault("zero_optimization", {})
    if args.zero_stage is not None:
        zero["stage"] = args.zero_stage
    if args.offload_params and zero.get("stage") != 3:
        raise ValueError(f"--offload-params needs ZeRO stage 3, not {zero.get('stage')}")
    if args.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if args.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    # DeepSpeed derives train_batch_size = micro-batch x accumulation x ranks.
    config.pop("train_batch_size", None)
    config["train_micro_batch_size_per_gpu"] = args.micro_batch
    config["gradient_accumulation_steps"] = args.grad_accum
    config["gradient_clipping"] = args.max_grad_norm
    config["bf16"] = {"enabled": on_gpu and args.precision != "fp32"}
    adamw = config.setdefault("optimizer", {"type": "AdamW"}).setdefault("params", {})
    adamw.update(lr=args.lr, weight_decay=args.weight_decay)
    if not on_gpu:
        # DeepSpeed's own Adam is compiled (FusedAdam on GPUs, CPUAdam in host memory); on a
        # machine without GPUs use torch's AdamW, offloaded or not.
        adamw["torch_adam"] = True
        config["zero_force_ds_cpu_optimizer"] = False
    return config


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


def build_model(args: argparse.Namespace, model_cfg: Any, ds_config: dict[str, Any]) -> nn.Module:
    """ZeRO-3: partitioned as it is built; ZeRO-1/2: built on meta, materialised once."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    if ds_config["zero_optimization"].get("stage") == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = AutoModelForCausalLM.from_config(model_cfg, dtype=torch.float32)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_cfg, dtype=torch.float32)
        model.to_empty(device=deepspeed.get_accelerator().current_device_name())
        with torch.no_grad():  # the weights, and the rotary buffers (in no checkpoint)
            model.init_weights()
    if args.activation_checkpointing:  # keep each block's input only; recompute the rest
        for block in blocks_of(model):
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def weight_files(path: str) -> list[Path]:
    """A ``.safetensors`` file, or every one in a directory (a sharded Hugging Face save)."""
    where = Path(path)
    files = sorted(where.glob("*.safetensors")) if where.is_dir() else [where]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no .safetensors weights at {where}")
    return files


def load_weights(model: nn.Module, path: str) -> None:
    """Rank 0 reads the files one at a time and writes each parameter, gathered for the moment.

    Under ZeRO-3 each parameter is gathered whole on every rank, written by rank 0 and
    partitioned again on leaving the ``GatheredParameters`` block: no rank holds more than one
    parameter whole. Under ZeRO-1/2 only rank 0's copy is written; ``deepspeed.initialize``
    then broadcasts rank 0's parameters to every rank. Weights in the files that the model
    does not have (old checkpoints carry rotary tables) are skipped.
    """
    import deepspeed
    from safetensors import safe_open

    rank = dist.get_rank()
    params = dict(model.named_parameters())  # a tied weight appears once, under one name
    buffers = {n: b for n, b in model.named_buffers() if n in model.state_dict()}
    info: list[Any] = [None, None]
    if rank == 0:
        listing = []
        for f in weight_files(path):
            with safe_open(f, framework="pt") as opened:
                listing.append((f, sorted(opened.keys())))
        found = {key for _, keys in listing for key in keys}
        tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
        info = [listing, sorted((set(params) | set(buffers)) - found - tied)]
    dist.broadcast_object_list(info, src=0)  # every rank learns the keys and what is missing
    listing, missing = info
    if missing:  # raised on every rank at once: no rank is left waiting in a collective
        raise ValueError(f"{path} lacks {len(missing)} weights of the model, e.g. {missing[:3]}")
    for f, keys in listing:
        with safe_open(f, framework="pt") if rank == 0 else contextlib.nullcontext() as opened:
            for key in keys:
                if key in params:
                    with deepspeed.zero.GatheredParameters([params[key]], modifier_rank=0):
                        if rank == 0:
                            params[key].data.copy_(opened.get_tensor(key))
                elif key in buffers:  # buffers are never partitioned: broadcast them
                    if rank == 0:
                        buffers[key].copy_(opened.get_tensor(key))
                    dist.broadcast(buffers[key], src=0)


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


def latest_checkpoint(directory: str | None) -> str | None:
    """The tag of the newest complete save, which ``latest`` names (written last, below)."""
    marker = Path(directory or "") / "latest"
    return marker.read_text().strip() if directory and marker.exists() else None


def save_checkpoint(directory: str, step: int, engine: Any) -> None:
    """DeepSpeed's checkpoint (each rank writes its partitions), then ``latest`` naming it.

    DeepSpeed's own ``latest`` file is written by rank 0 as soon as rank 0 has saved, while
    other ranks may still be writing; a rank dying then would leave ``latest`` naming an
    incomplete checkpoint. ``save_checkpoint`` ends in a barrier: after it, every rank is done.
    """
    tag = f"step-{step}"
    engine.save_checkpoint(directory, tag=tag, client_state={"step": step}, save_latest=False)
    if dist.get_rank() == 0:
        draft = Path(directory) / "latest.draft"
        draft.write_text(tag)
        draft.replace(Path(directory) / "latest")  # atomic: never half-written


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
    on_gpu = torch.cuda.is_available()
    if not on_gpu:  # before DeepSpeed is imported: it picks its device once, at import
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # DeepSpeed still calls collectives under the names torch has since deprecated.
    warnings.filterwarnings("ignore", message=r".*is deprecated. Please use `torch.distributed")
    ds_config = deepspeed_config(args, on_gpu)
    started_here = not dist.is_initialized()
    if started_here:  # torchrun, or the deepspeed launcher, set RANK, LOCAL_RANK, MASTER_*...
        if on_gpu:  # one GPU per rank, chosen before NCCL starts
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if on_gpu else "gloo")
    if not on_gpu:
        # On CPU DeepSpeed would compile its shared-memory collectives with a C++ compiler
        # in every process (over a minute); gloo does the same collectives without them.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # wraps the group above
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(deepspeed.get_accelerator().current_device_name())

    config = model_config(args)
    model = build_model(args, config, ds_config)
    if args.model or args.weights:
        load_weights(model, args.weights or args.model)
    params = [p for p in model.parameters() if p.requires_grad]
    # No weight decay on norms and biases. (ZeRO-3 left a placeholder in each parameter and
    # keeps its shape in ds_shape.)
    matrices = [p for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2]
    groups = [
        {"params": matrices, "weight_decay": args.weight_decay},
        {"params": [p for p in params if all(p is not m for m in matrices)], "weight_decay": 0.0},
    ]
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=groups, config=ds_config
    )

    start = 0
    if (tag := latest_checkpoint(args.checkpoint_dir)) is not None:
        _, client_state = engine.load_checkpoint(args.checkpoint_dir, tag=tag)
        start = int(client_state["step"])
        if rank == 0:
            print(f"resumed from step {start} ({args.checkpoint_dir}/{tag})", flush=True)
    tokens = token_stream(args, config.vocab_size)
    log = []
    for step in range(start, args.steps):
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        batches = micro_batches(tokens, step, args, rank, world_size)
        total = torch.zeros((), device=device)
        for batch in batches:
            loss = loss_of(engine, batch.to(device))
            engine.backward(loss)  # divides by gradient_accumulation_steps
            engine.step()  # steps the optimizer after the last micro-batch only
            total += loss.detach() / len(batches)
        norm = float(engine.get_global_grad_norm())  # before clipping, over all partitions
        dist.all_reduce(total)  # the mean over ranks (gloo has no AVG)
        entry = {
            "step": step + 1,
            "loss": total.item() / world_size,
            "grad_norm": norm,
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
            save_checkpoint(args.checkpoint_dir, step + 1, engine)
            if rank == 0:
                print(f"saved step {step + 1}", flush=True)
    if on_gpu and rank == 0:
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    if started_here:
        del engine, optimizer, model  # before their process group goes: freeing them later can hang
        dist.destroy_process_group()
    return log


if __name__ == "__main__":
    main()
