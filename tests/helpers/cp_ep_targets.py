"""What the context- and expert-parallel tests run on each launched rank.

One launch per world size does every check of a test file: ring attention against full
attention for each mask and layout, then the training runs whose figures the planner
predicts.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import Tensor

from fsdp_guide.comm import count_collectives
from fsdp_guide.parallel import record_ring_steps, ring_attention, shard_sequence

#: Ring attention's test sizes: batch, heads, tokens (the whole sequence), head_dim.
B, H, S, D = 2, 2, 16, 8
CASES = [(causal, layout) for causal in (False, True) for layout in ("naive", "zigzag")]


def _full_attention(causal: bool) -> tuple[list[Tensor], Tensor, list[Tensor], Tensor]:
    """Seeded q, k, v, the full attention's output and gradients, and the output weights."""
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(B, H, S, D, generator=g) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=causal)
    (out * w).sum().backward()
    grads = [t.grad for t in full]
    assert all(g is not None for g in grads)
    return [q, k, v], out.detach(), grads, w  # type: ignore[return-value]


def ring_case(rank: int, ranks: int, causal: bool, layout: str) -> dict[str, Any]:
    """Ring attention of this rank's share against the full attention's, and what it cost."""
    from fsdp_guide.wrap import saved_activation_bytes

    inputs, out, grads, w = _full_attention(causal)

    def mine(t: Tensor) -> Tensor:
        return shard_sequence(t, rank, ranks, layout, dim=2)  # type: ignore[arg-type]

    local = [mine(t).requires_grad_() for t in inputs]
    with count_collectives() as counter, record_ring_steps() as events:
        saved, result = saved_activation_bytes(
            torch.nn.Identity(),
            lambda: ring_attention(*local, causal=causal, layout=layout),  # type: ignore[arg-type]
        )
        (result * mine(w)).sum().backward()
    errors = [(result - mine(out)).abs().max().item()]
    errors += [(t.grad - mine(g)).abs().max().item() for t, g in zip(local, grads, strict=True)]
    return {
        "errors": errors,
        "sent": counter.stats.elements_by_kind(),
        "saved": saved,
        "shares": [step.share for step in events if step.phase == "forward"],
    }


def context_parallel_checks(
    rank: int, world_size: int, runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """Every ring case at ``world_size`` ranks, then each training run of ``runs``."""
    from fsdp_guide.parallel import train_context_parallel

    warnings.filterwarnings("ignore")
    ring = {case: ring_case(rank, world_size, *case) for case in CASES}
    trained = [train_context_parallel(rank, world_size, **kwargs) for kwargs in runs]
    return {"ring": ring, "trained": trained}


def moe_block(seed: int = 0) -> Any:
    """A Mixtral MoE block of 4 experts, 2 per token, weights large enough to route unevenly."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
    )
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    block = MixtralSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block


def _tokens(ranks: int, per_rank: int = 3, seq: int = 5) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ranks * per_rank, seq, 16, generator=g)
    return x, torch.randn(x.shape, generator=g)


def expert_layer_checks(rank: int, world_size: int) -> dict[str, Any]:
    """:class:`ExpertParallelMoE` on this rank's tokens against the whole block on all of
    them; the same layer with a capacity, and with a router skewed to rank 0's experts."""
    import torch.distributed as dist

    from fsdp_guide.parallel import ExpertParallelMoE

    warnings.filterwarnings("ignore")
    block = moe_block()
    x, w = _tokens(world_size)
    whole = x.clone().requires_grad_()
    reference = block(whole)
    (reference * w).sum().backward()
    moe = ExpertParallelMoE(copy.deepcopy(block))
    for p in moe.parameters():
        p.grad = None
    mine = slice(rank * 3, rank * 3 + 3)
    local = x[mine].clone().requires_grad_()
    with count_collectives() as counter:
        out = moe(local)
        (out * w[mine]).sum().backward()
    router = moe.gate.weight.grad
    assert router is not None and local.grad is not None
    dist.all_reduce(router)  # each rank's router saw its own tokens
    first, n = moe.first, moe.local
    experts = block.experts
    errors = {
        "output": (out - reference[mine]).abs().max().item(),
        "input grad": (local.grad - whole.grad[mine]).abs().max().item(),  # type: ignore[index]
        "gate_up grad": (
            moe.experts.gate_up_proj.grad - experts.gate_up_proj.grad[first : first + n]
        )
        .abs()
        .max()
        .item(),
        "down grad": (moe.experts.down_proj.grad - experts.down_proj.grad[first : first + n])
        .abs()
        .max()
        .item(),
        "router grad": (router - block.gate.weight.grad).abs().max().item(),
    }
    capped = ExpertParallelMoE(copy.deepcopy(block), capacity_factor=0.5)
    with torch.no_grad():
        capped(x[mine])
        # Skewed: every token shares a component that rank 0's experts' router rows favour.
        skewed = ExpertParallelMoE(copy.deepcopy(block))
        skewed.gate.weight[:n] += 1.0
        skewed(x[mine] + 0.5)
        _, _, chosen = block.gate(x[mine].reshape(-1, 16))
    return {
        "errors": errors,
        "all_to_all": counter.stats.elements_by_kind().get("all_to_all", 0),
        "routing": moe.routing,
        "uncapped": torch.bincount(chosen.reshape(-1), minlength=4).tolist(),
        "capped": capped.routing,
        "skewed": skewed.routing,
    }


def expert_parallel_checks(
    rank: int, world_size: int, ep: int, config: Any, layer_checks: bool
) -> dict[str, Any]:
    """The layer's checks (when asked), then a training run with expert parallelism."""
    from fsdp_guide.parallel import train_expert_parallel

    warnings.filterwarnings("ignore")
    layer = expert_layer_checks(rank, world_size) if layer_checks else None
    trained = train_expert_parallel(rank, world_size, ep, config, batch_size=4, seq_len=8)
    return {"layer": layer, "trained": trained}
