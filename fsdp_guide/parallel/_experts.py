"""Expert parallelism: a mixture-of-experts layer whose experts are spread over ranks (private).

A mixture-of-experts layer routes each token to ``top_k`` of its ``E`` experts. With expert
parallelism each of ``e`` ranks holds ``E / e`` of them, and a layer's forward is:

1. route: the router (replicated on every rank) picks each token's experts and weights;
2. count: each rank tells every other how many token copies it will send to each of its
   experts (an all-to-all of ``E`` counts), so everyone knows what it will receive;
3. dispatch: the copies, sorted by expert, go to the ranks holding their experts (an
   all-to-all with uneven splits, ``all_to_all_single``);
4. compute: each rank runs its experts on what it received;
5. combine: the results go back where their tokens came from (a second all-to-all), are
   weighted and summed per token.

Backward mirrors the two token all-to-alls. :class:`ExpertParallelMoE` is built from a
transformers MoE block (Mixtral's ``MixtralSparseMoeBlock``, Qwen-MoE's): its router, and
its grouped experts' weights (``gate_up_proj``, ``down_proj``) cut to the rank's share.

A **capacity** bounds the copies each rank sends to each expert: ``ceil(capacity_factor ·
tokens · top_k / E)``; copies past it are dropped (the token keeps its other experts, and
its residual path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LocalExperts(nn.Module):
    """The experts one rank holds, as transformers' grouped experts store them.

    Attributes:
        gate_up_proj: ``(n, 2 · intermediate, hidden)``: each expert's gate and up weights.
        down_proj: ``(n, hidden, intermediate)``.
    """

    def __init__(self, gate_up_proj: Tensor, down_proj: Tensor, act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        self.act_fn = act_fn

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """Each expert on its rows of ``x`` (sorted by expert, ``counts[i]`` rows for
        expert ``i``): ``down · (act(gate · x) * (up · x))``, as Mixtral's experts compute."""
        outputs = []
        for i, rows in enumerate(torch.split(x, counts.tolist())):
            gate, up = F.linear(rows, self.gate_up_proj[i]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, self.down_proj[i]))
        return torch.cat(outputs) if outputs else x[:0]


@dataclass(frozen=True)
class Routing:
    """What one forward of an :class:`ExpertParallelMoE` routed, on this rank.

    Attributes:
        sent: Token copies this rank sent each expert (``E`` counts, after the capacity).
        received: Token copies this rank's experts received from each rank, ``[rank][expert]``.
        dropped: Copies past the capacity, dropped on this rank.
        capacity: Copies each rank may send each expert, or ``None`` for no limit.
    """

    sent: tuple[int, ...]
    received: tuple[tuple[int, ...], ...]
    dropped: int
    capacity: int | None

    @property
    def received_total(self) -> int:
        """Token copies this rank's experts computed."""
        return sum(map(sum, self.received))


def _group(group: Any) -> tuple[Any, int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None, 0, 1
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


class ExpertParallelMoE(nn.Module):
    """A transformers MoE block whose experts are spread over the ranks of ``group``.

    Args:
        block: A block with a router ``gate`` (returning ``(logits, weights, experts)``
            per token, its ``top_k`` on the block or the router) and grouped ``experts``
            (``gate_up_proj``, ``down_proj``, ``act_fn``, ``num_experts``), and optionally a
            ``shared_expert`` with its ``shared_expert_gate``, replicated: Mixtral's
            ``MixtralSparseMoeBlock``, Qwen-MoE's ``Qwen2MoeSparseMoeBlock``.
        group: The expert-parallel ranks (the default group if ``None``; one rank holds
            every expert without a process group).
        capacity_factor: Copies each rank may send each expert, as a multiple of an even
            share (``tokens · top_k / E``); ``None`` for no limit.

    Raises:
        ValueError: When the experts do not divide over the ranks, or the capacity factor
            is not positive.

    Examples:
        >>> import transformers
        >>> config = transformers.MixtralConfig(hidden_size=8, intermediate_size=16,
        ...     num_local_experts=4, num_experts_per_tok=2)
        >>> config._experts_implementation = "eager"
        >>> block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
        >>> _ = torch.manual_seed(0), [torch.nn.init.normal_(p) for p in block.parameters()]
        >>> moe = ExpertParallelMoE(block)  # no process group: one rank, every expert
        >>> x = torch.randn(2, 3, 8)
        >>> torch.allclose(moe(x), block(x), atol=1e-6), moe.routing.received_total
        (True, 12)
    """

    def __init__(
        self, block: nn.Module, group: Any = None, capacity_factor: float | None = None
    ) -> None:
        super().__init__()
        experts: Any = block.experts
        self.group, rank, ranks = _group(group)
        self.num_experts: int = int(experts.num_experts)
        if self.num_experts % ranks:
            raise ValueError(
                f"{self.num_experts} experts do not divide over {ranks} ranks: choose a number "
                "of expert-parallel ranks that divides them"
            )
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor!r}")
        self.ranks, self.local = ranks, self.num_experts // ranks
        self.first = rank * self.local  # the rank's experts: first, first + 1, ...
        self.gate: nn.Module = getattr(block, "gate")  # noqa: B009 (the router, replicated)
        top_k = getattr(block, "top_k", None) or getattr(self.gate, "top_k", None)
        self.top_k = int(top_k)  # type: ignore[arg-type]
        self.capacity_factor = capacity_factor
        # Qwen-MoE's shared expert sees every token: a dense MLP, replicated like the router.
        self.shared_expert: nn.Module | None = getattr(block, "shared_expert", None)
        self.shared_expert_gate: nn.Module | None = getattr(block, "shared_expert_gate", None)
        mine = slice(self.first, self.first + self.local)
        self.experts = LocalExperts(
            experts.gate_up_proj.detach()[mine].clone(),
            experts.down_proj.detach()[mine].clone(),
            experts.act_fn,
        )
        self.routing = Routing(sent=(), received=(), dropped=0, capacity=None)
        self.router_logits: Tensor | None = None  # the last forward's, for a balancing loss

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits, weights, chosen = self.gate(x)
        self.router_logits = logits
        order, sent, capacity, dropped = self._sort_and_cap(chosen.reshape(-1), x.shape[0])
        routed = x[order // self.top_k]  # one row per kept copy, sorted by expert
        received = self._exchange_counts(sent)
        self.routing = Routing(
            sent=tuple(sent.tolist()),
            received=tuple(tuple(row) for row in received.tolist()),
            dropped=dropped,
            capacity=capacity,
        )
        out = self._dispatch_compute_combine(routed, sent, received)
        weighted = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        combined = torch.zeros_like(x).index_add(0, order // self.top_k, weighted.to(x.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x)
            combined = combined + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return combined.reshape(shape)

    def _sort_and_cap(self, flat: Tensor, tokens: int) -> tuple[Tensor, Tensor, int | None, int]:
        """The copies kept, sorted by expert (indices into ``flat``), their counts per expert,
        the capacity and the copies dropped."""
        order = torch.argsort(flat, stable=True)  # by expert, then by token
        counts = torch.bincount(flat, minlength=self.num_experts)
        capacity = None
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)
            starts = torch.cumsum(counts, 0) - counts
            position = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
            order = order[position < capacity]  # the first `capacity` tokens of each expert
            kept = counts.clamp(max=capacity)
        else:
            kept = counts
        return order, kept, capacity, int((counts - kept).sum())

    def _exchange_counts(self, sent: Tensor) -> Tensor:
        """``received[rank][i]``: copies rank ``rank`` sends this rank's ``i``-th expert."""
        if self.ranks == 1:
            return sent.reshape(1, -1)
        import torch.distributed as dist

        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        return received.reshape(self.ranks, self.local)

    def _dispatch_compute_combine(self, routed: Tensor, sent: Tensor, received: Tensor) -> Tensor:
        send_splits = sent.reshape(self.ranks, self.local).sum(1).tolist()
        recv_splits = received.sum(1).tolist()
        arrived = _all_to_all(routed, recv_splits, send_splits, self.group, self.ranks)
        # Arrived: by source rank, then by expert. The experts want them by expert.
        by_expert = _by_expert(received)
        computed = self.experts(arrived[by_expert], received.sum(0))
        back = computed[torch.argsort(by_expert)]  # by source rank again
        return _all_to_all(back, send_splits, recv_splits, self.group, self.ranks)


def _by_expert(received: Tensor) -> Tensor:
    """The permutation that takes rows ordered (source rank, expert) to (expert, source rank)."""
    ranks, local = received.shape
    starts = (torch.cumsum(received.reshape(-1), 0) - received.reshape(-1)).reshape(ranks, local)
    pieces = [
        torch.arange(int(starts[r, i]), int(starts[r, i] + received[r, i]))
        for i in range(local)
        for r in range(ranks)
    ]
    return torch.cat(pieces).to(received.device) if pieces else received.new_zeros(0)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back the way
    the rows came (the splits swapped)."""

    @staticmethod
    def forward(
        ctx: Any, tensor: Tensor, output_splits: list[int], input_splits: list[int], group: Any
    ) -> Tensor:
        import torch.distributed as dist

        ctx.splits, ctx.group = (output_splits, input_splits), group
        output = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
        dist.all_to_all_single(output, tensor.contiguous(), output_splits, input_splits, group)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        output_splits, input_splits = ctx.splits
        back = _AllToAll.apply(grad.contiguous(), input_splits, output_splits, ctx.group)  # type: ignore[no-untyped-call]
        return back, None, None, None


def _all_to_all(
    tensor: Tensor, output_splits: list[int], input_splits: list[int], group: Any, ranks: int
) -> Tensor:
    """Rows to the ranks ``input_splits`` says, rows from those ``output_splits`` says."""
    if ranks == 1:
        return tensor
    result: Tensor = _AllToAll.apply(tensor, output_splits, input_splits, group)  # type: ignore[no-untyped-call]
    return result


def expert_parallelize(
    model: nn.Module, group: Any = None, capacity_factor: float | None = None
) -> list[ExpertParallelMoE]:
    """Replace every transformers MoE block of ``model`` (a module with a ``gate`` router
    and grouped ``experts``) by an :class:`ExpertParallelMoE` over ``group``, in place.

    Returns:
        The new layers, in module order.
    """
    layers = []
    for name, module in list(model.named_modules()):
        experts = getattr(module, "experts", None)
        if hasattr(module, "gate") and hasattr(experts, "gate_up_proj"):
            layer = ExpertParallelMoE(module, group, capacity_factor)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, layer)
            layers.append(layer)
    return layers
