"""Small demo models and seeded synthetic data, sized so every lesson runs in seconds on CPU.

:class:`TinyTransformer` is a stack of identical :class:`Block` layers, so wrap and
activation-checkpointing policies have a layer class to select. :class:`MLP` is the
smallest thing worth sharding. Data is generated from a seed, identically on every rank;
:func:`shard_batch` gives each rank a contiguous slice of the global batch, so a sharded
run and an unsharded run see the same samples and their losses can be compared.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "MLP",
    "Block",
    "TinyTransformer",
    "TransformerConfig",
    "build_model",
    "count_params",
    "loss_fn",
    "shard_batch",
    "synthetic_batch",
]

ModelName = Literal["transformer", "mlp"]
#: The names :func:`build_model` and :func:`synthetic_batch` take.
MODEL_NAMES: tuple[ModelName, ...] = get_args(ModelName)
Batch = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes of :class:`TinyTransformer`.

    Attributes:
        vocab_size: Number of token ids.
        dim: Width of the residual stream.
        n_heads: Attention heads per block (``dim`` must divide by it).
        n_layers: Number of :class:`Block` layers.
        seq_len: Longest sequence (size of the position embedding).
        mlp_ratio: Hidden width of each block's MLP, as a multiple of ``dim``.
    """

    vocab_size: int = 256
    dim: int = 128
    n_heads: int = 4
    n_layers: int = 4
    seq_len: int = 32
    mlp_ratio: int = 4


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP, each residual."""

    def __init__(self, dim: int, n_heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim={dim} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        out: Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class TinyTransformer(nn.Module):
    """A GPT-shaped language model: embeddings, ``n_layers`` :class:`Block` s, a head.

    Examples:
        >>> model = TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2))
        >>> tokens, targets = synthetic_batch("transformer", batch_size=3, config=model.config)
        >>> model(tokens).shape
        torch.Size([3, 32, 256])
    """

    def __init__(self, config: TransformerConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or TransformerConfig()
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.pos_emb = nn.Embedding(config.seq_len, config.dim)
        self.blocks = nn.ModuleList(
            Block(config.dim, config.n_heads, config.mlp_ratio) for _ in range(config.n_layers)
        )
        self.ln_f = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.ln_f(x))
        return logits


class MLP(nn.Module):
    """A plain multi-layer perceptron for regression.

    Examples:
        >>> MLP(in_features=8, hidden=16, depth=2, out_features=1)(torch.zeros(4, 8)).shape
        torch.Size([4, 1])
    """

    def __init__(
        self, in_features: int = 32, hidden: int = 256, depth: int = 3, out_features: int = 8
    ) -> None:
        super().__init__()
        widths = [in_features, *([hidden] * depth)]
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.net(x)
        return out


def check_model_name(name: object) -> ModelName:
    """``name`` itself when it names a demo model: the one model-name check of the package.

    Args:
        name: ``"transformer"`` or ``"mlp"``.

    Returns:
        ``name``, typed as a :data:`ModelName`.

    Raises:
        ValueError: For any other value.

    Examples:
        >>> check_model_name("mlp")
        'mlp'
        >>> check_model_name("resnet")
        Traceback (most recent call last):
        ...
        ValueError: unknown model 'resnet'; choose 'transformer' or 'mlp'
    """
    for known in MODEL_NAMES:
        if name == known:
            return known
    choices = " or ".join(repr(n) for n in MODEL_NAMES)
    raise ValueError(f"unknown model {name!r}; choose {choices}")


def build_model(name: ModelName = "transformer", seed: int = 0) -> nn.Module:
    """Build a demo model with seeded weights, identical on every rank.

    Args:
        name: ``"transformer"`` (:class:`TinyTransformer`) or ``"mlp"`` (:class:`MLP`).
        seed: Seed of the initial weights.

    Raises:
        ValueError: For an unknown name.

    Examples:
        >>> count_params(build_model("mlp"))
        142088
    """
    name = check_model_name(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyTransformer() if name == "transformer" else MLP()


def count_params(module: nn.Module) -> int:
    """Number of parameter elements, each parameter counted once.

    Examples:
        >>> count_params(nn.Linear(3, 2))
        8
    """
    return sum(p.numel() for p in module.parameters())


def synthetic_batch(
    name: ModelName = "transformer",
    batch_size: int = 8,
    step: int = 0,
    seed: int = 0,
    config: TransformerConfig | None = None,
) -> Batch:
    """The global batch of a training step, the same on every rank for the same arguments.

    For the transformer: random token ids and the next-token targets. For the MLP:
    Gaussian inputs and targets from a fixed random linear map plus noise.

    Examples:
        >>> x, y = synthetic_batch("mlp", batch_size=4)
        >>> x.shape, y.shape
        (torch.Size([4, 32]), torch.Size([4, 8]))
        >>> torch.equal(synthetic_batch("mlp", step=1)[0], synthetic_batch("mlp", step=1)[0])
        True
    """
    name = check_model_name(name)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if name == "transformer":
        cfg = config or TransformerConfig()
        seq = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    w = torch.randn(32, 8, generator=torch.Generator().manual_seed(seed))
    x = torch.randn(batch_size, 32, generator=g)
    return x, x @ w + 0.1 * torch.randn(batch_size, 8, generator=g)


def shard_batch(
    batch: Batch, rank: int, world_size: int, device: torch.device | str | None = None
) -> Batch:
    """This rank's contiguous slice of a global batch: the ``k`` rows from ``rank * k`` on.

    ``k`` is ``batch_size // world_size``. The slices are disjoint and of equal size, so
    every sample is used once per step and the mean of the ranks' losses is the loss of the
    whole batch. It is not the split a :class:`~torch.utils.data.DistributedSampler` makes:
    the sampler deals indices out in turn (rank ``r`` gets ``indices[r::world_size]``), so
    the same samples reach other ranks.

    Args:
        batch: Inputs and targets of the whole step, the same on every rank.
        rank: This rank.
        world_size: Number of ranks.
        device: Where to put the slices, inputs and targets alike: the rank's device
            (:func:`fsdp_guide.launcher.rank_device`), where the model is. ``None`` leaves
            them where ``batch`` is.

    Raises:
        ValueError: When the batch size does not divide by ``world_size``.

    Examples:
        >>> x, y = shard_batch(synthetic_batch("mlp", batch_size=8), rank=1, world_size=4)
        >>> x.shape[0]
        2
        >>> rows = torch.arange(8)
        >>> shard_batch((rows, rows), rank=1, world_size=4)[0].tolist()
        [2, 3]
        >>> from torch.utils.data import DistributedSampler
        >>> list(DistributedSampler(range(8), num_replicas=4, rank=1, shuffle=False))
        [1, 5]
        >>> shard_batch((rows, rows), rank=0, world_size=2, device="meta")[1].device
        device(type='meta')
    """
    n = batch[0].shape[0]
    if n % world_size:
        raise ValueError(f"batch size {n} does not divide by world_size={world_size}")
    per = n // world_size
    x, y = batch[0][rank * per : (rank + 1) * per], batch[1][rank * per : (rank + 1) * per]
    if device is None:
        return x, y
    return x.to(device), y.to(device)


def loss_fn(model: nn.Module, batch: tuple[Any, Tensor | None]) -> Tensor:
    """Cross-entropy for token models, mean squared error otherwise; any model's own loss.

    ``batch`` is ``(inputs, targets)``: inputs a tensor, a tuple (positional arguments) or a
    dict (keyword arguments); targets ``None`` when labels are among the inputs. A
    transformers ``ModelOutput`` gives its ``loss``, else its logits with cross-entropy
    (:func:`fsdp_guide.outputs.model_loss` has the rules).

    Raises:
        PlanError: For an output with nothing to compute a loss from; the message says what
            to pass.

    Examples:
        >>> model = build_model("mlp")
        >>> loss = loss_fn(model, synthetic_batch("mlp"))
        >>> loss.backward()  # a scalar with a graph, ready for backward
        >>> loss.item() > 0
        True
    """
    from fsdp_guide.outputs import model_loss

    return model_loss(model, batch)
