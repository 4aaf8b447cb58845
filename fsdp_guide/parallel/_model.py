"""A transformer whose blocks tensor parallelism can cut, and the plan that cuts them (private).

Tensor parallelism splits a linear layer's weight across ranks: ``ColwiseParallel`` by output
features (each rank computes some of the outputs), ``RowwiseParallel`` by input features
(each rank computes a partial sum, all-reduced). A colwise layer followed by a rowwise one
needs no communication in between, so attention (``wq``, ``wk``, ``wv`` colwise, ``wo``
rowwise: each rank keeps whole heads) and the MLP (``w1`` colwise, ``w2`` rowwise) each cost
one all-reduce in forward, and in backward one all-reduce of the input's gradient per colwise
layer. The block keeps ``q``, ``k`` and ``v`` apart and infers its heads from the width it
receives, so the same code runs whole or cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: Which layer of each block is cut how, by its name in the block.
TP_PLAN: dict[str, str] = {
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.wo": "rowwise",
    "feed_forward.w1": "colwise",
    "feed_forward.w2": "rowwise",
}


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Sizes of :class:`ParallelTransformer`.

    Attributes:
        vocab_size: Token ids.
        dim: Width of the residual stream.
        n_heads: Attention heads (divisible by the tensor-parallel degree).
        n_layers: Blocks.
        seq_len: Longest sequence.
        hidden: Width of each block's MLP.
    """

    vocab_size: int = 256
    dim: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 16
    hidden: int = 256


class Attention(nn.Module):
    """Causal self-attention with separate ``wq``, ``wk``, ``wv`` and an output ``wo``."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # -1 heads: a tensor-parallel rank receives only its share of them.
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in self._qkv())
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        result: Tensor = self.wo(out.transpose(1, 2).reshape(b, t, -1))
        return result

    def _qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.wq, self.wk, self.wv


class FeedForward(nn.Module):
    """``w2(gelu(w1(x)))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        result: Tensor = self.w2(F.gelu(self.w1(x)))
        return result


class ParallelBlock(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))``, then ``x + feed_forward(norm(x))``."""

    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim={dim} must be divisible by n_heads={n_heads}")
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        result: Tensor = x + self.feed_forward(self.ffn_norm(x))
        return result


class TokenEmbedding(nn.Module):
    """The first layer of a pipelined :class:`ParallelTransformer`: its token and position
    embeddings (the model's own modules), from token ids to the residual stream."""

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = tok_emb, pos_emb

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        result: Tensor = self.tok_emb(tokens) + self.pos_emb(positions)
        return result


class OutputHead(nn.Module):
    """The last layer of a pipelined :class:`ParallelTransformer`: its final norm and head."""

    def __init__(self, norm: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x: Tensor) -> Tensor:
        result: Tensor = self.head(self.norm(x))
        return result


class ParallelTransformer(nn.Module):
    """Token and position embeddings, transformer blocks, a norm and a head.

    Examples:
        >>> model = ParallelTransformer(ParallelConfig(n_layers=1))
        >>> model(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 16, 256])
    """

    #: The layers tensor parallelism cuts (what :func:`fsdp_guide.memory.plan` reads).
    tp_plan = TP_PLAN

    def __init__(self, config: ParallelConfig | None = None) -> None:
        super().__init__()
        c = config or ParallelConfig()
        self.config = c
        self.tok_emb = nn.Embedding(c.vocab_size, c.dim)
        self.pos_emb = nn.Embedding(c.seq_len, c.dim)
        self.blocks = nn.ModuleList(
            ParallelBlock(c.dim, c.n_heads, c.hidden) for _ in range(c.n_layers)
        )
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab_size)

    def example_batch(self, batch_size: int, seq_len: int) -> tuple[Tensor, Tensor]:
        """Token ids and targets of a batch (zeros), what the planner traces the model on."""
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        return ids, ids.clone()

    def pipeline_layers(self) -> nn.Sequential:
        """The model as the sequence of layers a pipeline cuts into stages: the embeddings,
        each block, the norm and head; the model's own modules, so training them trains it.

        Examples:
            >>> layers = ParallelTransformer(ParallelConfig(n_layers=2)).pipeline_layers()
            >>> [type(layer).__name__ for layer in layers]
            ['TokenEmbedding', 'ParallelBlock', 'ParallelBlock', 'OutputHead']
        """
        return nn.Sequential(
            TokenEmbedding(self.tok_emb, self.pos_emb),
            *self.blocks,
            OutputHead(self.norm, self.head),
        )

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.norm(x))
        return logits
