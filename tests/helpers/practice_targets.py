"""Launched ranks for the planner's accumulation, frozen-parameter and tied-weight tests.

Each function trains the same small transformer under one catalog strategy (built by its
engine, as ``compare`` builds it) and returns what the planner predicts: the gradient bytes
held between micro-steps, the collectives counted over an optimizer step, the state after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_guide.comm import count_collectives
from fsdp_guide.engines import engine_for
from fsdp_guide.memory import measure_model_state
from fsdp_guide.models import TinyTransformer, TransformerConfig

CONFIG = TransformerConfig(n_layers=2, dim=32, n_heads=2, seq_len=16)
BATCH = 2


def tiny(frozen: tuple[str, ...] = (), tied: bool = False) -> nn.Module:
    """The seeded model; parameters whose name starts with one of ``frozen`` do not train."""
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    if tied:
        model.head.weight = model.tok_emb.weight
    for name, p in model.named_parameters():
        if name.startswith(frozen):
            p.requires_grad_(False)
    return model


def _batch(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len), generator=generator)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


@contextlib.contextmanager
def _sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Gradient sync on or off for one micro-step: FSDP2's switch, DDP's and FSDP1's no_sync."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
        yield
    elif sync:
        yield
    else:
        with model.no_sync():
            yield


def accumulate(
    rank: int, world_size: int, strategy: str, sync_each: bool, k: int = 3
) -> dict[str, Any]:
    """One optimizer step over ``k`` micro-steps: the gradients held after the first, the
    collectives of the whole step."""
    model, optimizer = engine_for(strategy).build(
        tiny(), device=torch.device("cpu"), world_size=world_size, lr=1e-3
    )
    held = -1
    with count_collectives() as counter:
        for i in range(k):
            with _sync(model, sync_each or i == k - 1):
                _loss(model, _batch(rank, i)).backward()
            if i == 0:
                held = measure_model_state(model).grads
        optimizer.step()
    return {"held": held, "collectives": counter.stats.elements_by_kind()}


def frozen_step(
    rank: int, world_size: int, strategy: str, frozen: tuple[str, ...]
) -> dict[str, Any]:
    """A step with the parameters named by ``frozen`` not training."""
    model, optimizer = engine_for(strategy).build(
        tiny(frozen), device=torch.device("cpu"), world_size=world_size, lr=1e-3
    )
    for step in range(2):  # DDP regroups its buckets at the second forward
        _loss(model, _batch(rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    with count_collectives() as counter:
        _loss(model, _batch(rank, 2)).backward()
        optimizer.step()
    return {
        "state": measure_model_state(model, optimizer),
        "collectives": counter.stats.elements_by_kind(),
    }


def tied_step(rank: int, world_size: int, together: bool) -> dict[str, Any]:
    """FSDP2 with the embedding tied to the head: both in one unit, or both in the root."""
    from torch.distributed.fsdp import fully_shard

    model = tiny(tied=True)
    for block in model.blocks:
        fully_shard(block)
    if together:
        fully_shard([model.tok_emb, model.head])
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with count_collectives() as counter:
        loss = _loss(model, _batch(rank, 0))
        loss.backward()
        optimizer.step()
    return {
        "loss": loss.item(),
        "state": measure_model_state(model, optimizer),
        "collectives": counter.stats.elements_by_kind(),
    }


def split_tied(rank: int, world_size: int) -> str:
    """What ``fully_shard`` says when a tied parameter's modules are in two units."""
    from torch.distributed.fsdp import fully_shard

    model = tiny(tied=True)
    fully_shard(model.tok_emb)
    fully_shard(model)
    try:
        _loss(model, _batch(rank, 0))  # FSDP2 checks its groups at the first forward
    except ValueError as error:
        return str(error)
    return ""


def mixed_step(rank: int, world_size: int, reduce_fp32: bool | None) -> dict[str, Any]:
    """FSDP2 in fp32 (``None``) or with bf16 parameters, reducing in fp32 or in bf16: two
    micro-steps, the sync held back on the first, then one optimizer step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if reduce_fp32 is not None:
        reduce = torch.float32 if reduce_fp32 else None
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    model = tiny()
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with count_collectives() as counter:
        for i in range(2):
            model.set_requires_gradient_sync(i == 1)  # type: ignore[operator]
            loss = _loss(model, _batch(rank, 0))
            loss.backward()
            if i == 0:
                held = measure_model_state(model).grads
        optimizer.step()
    return {
        "loss": loss.item(),
        "held": held,
        "bytes": {k: c.bytes for k, c in counter.stats.kinds.items()},
        "state": measure_model_state(model, optimizer),
    }


LLAMA = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}


def lora_llama() -> nn.Module:
    """A small transformers Llama with LoRA adapters of rank 8 on q_proj and v_proj."""
    from peft import LoraConfig, get_peft_model

    from fsdp_guide.hf import hf_builder

    torch.manual_seed(0)
    adapters = LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    model: nn.Module = get_peft_model(hf_builder("llama", LLAMA)(), adapters)
    return model


def lora_step(rank: int, world_size: int) -> dict[str, Any] | None:
    """FSDP2 over the LoRA model, a unit per decoder layer; None without peft."""
    try:
        model = lora_llama()
    except ImportError:
        return None
    from torch.distributed.fsdp import fully_shard
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    for module in model.modules():
        if isinstance(module, LlamaDecoderLayer):
            fully_shard(module)
    fully_shard(model)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tokens = _batch(rank, 0)
    with count_collectives() as counter:
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
    return {
        "state": measure_model_state(model, optimizer),
        "collectives": counter.stats.elements_by_kind(),
    }


def everything(rank: int, world_size: int) -> dict[str, Any]:
    """Every run of the tests in one launch (starting ranks is the slow part)."""
    return {
        "accumulate": {
            (s, sync): accumulate(rank, world_size, s, sync)
            for s, sync in (("fsdp2", False), ("fsdp2", True), ("ddp", False), ("fsdp", False))
        },
        "frozen": {
            s: frozen_step(rank, world_size, s, ("tok_emb", "pos_emb", "blocks.0"))
            for s in ("fsdp2", "ddp")
        },
        "tied": {t: tied_step(rank, world_size, t) for t in (False, True)},
        "split": split_tied(rank, world_size),
        "mixed": {r: mixed_step(rank, world_size, r) for r in (None, False, True)},
        "lora": lora_step(rank, world_size),
    }


def _fsdp2(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def async_save_then_train(
    rank: int, world_size: int, path: str, steps_before: int, kill: bool = False
) -> dict[str, Any]:
    """Train ``steps_before`` steps, start a background save, train one more step, then wait.

    With ``kill``, rank 1 is killed (SIGKILL) as soon as the save has returned, while the
    background thread writes: the save never finishes.
    """
    import os
    import signal

    from fsdp_guide.checkpoint import save

    model, optimizer = _fsdp2(tiny())
    for step in range(steps_before):
        _loss(model, _batch(rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    at_call = _full_state(model)
    pending = save(
        path, model, optimizer, kind="sharded", extra={"step": steps_before}, blocking=False
    )
    if kill and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _loss(model, _batch(rank, steps_before)).backward()
    optimizer.step()
    after = _full_state(model)
    pending.wait()
    return {"at_call": at_call, "after": after, "staged": pending.staged_bytes}
