"""What context parallelism leaves on each rank, and what its ring sends (private).

Context parallelism cuts every sequence over ``c`` ranks: each computes ``seq_len / c`` of
the tokens through every layer, and its attention passes the K/V blocks round a ring
(:func:`fsdp_guide.parallel.ring_attention`). Nothing of the model is cut: the ranks of a
context-parallel group hold the same weights and compute their gradients on other tokens, so
the strategy shards (or replicates) the model over them as over data-parallel ranks.

Activations are traced on ``seq_len / c`` tokens. Ring attention saves this rank's queries,
keys, values, output and log-sum-exp, the tensors CPU flash attention
(``scaled_dot_product_attention``) saves on the same tokens, so the rank's trace is the run's.

The ring's messages per training step are counted from the K/V the rank's attention computes
with: ``c - 1`` blocks in forward, ``c - 1`` blocks and ``c - 1`` gradient blocks in
backward, each a block of this rank's keys and values. They are read from one forward on
fake tensors, which records the ``key`` and ``value`` of each ``scaled_dot_product_attention``
call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from fsdp_guide.errors import PlanError
from fsdp_guide.memory._trace import BatchBuilder

if TYPE_CHECKING:
    from fsdp_guide.memory._dimensions import RankModel
    from fsdp_guide.memory._request import PlanRequest

#: How a context-parallel rank's tokens are chosen.
CP_LAYOUTS = ("naive", "zigzag")


def check_context_parallel(
    context_parallel: object, layout: object, ranks: int, seq_len: int
) -> int:
    """``context_parallel`` checked against the ranks it shares with data parallelism
    (``world_size // tensor_parallel``) and the sequence its layout cuts.

    Raises:
        PlanError: A degree that is not an int dividing ``ranks``, an unknown layout, a
            sequence that does not cut into ``c`` (``"naive"``) or ``2c`` (``"zigzag"``)
            equal chunks.

    Examples:
        >>> check_context_parallel(2, "zigzag", 4, 16)
        2
        >>> check_context_parallel(4, "zigzag", 4, 12)
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.PlanError: seq_len=12 is not divisible by 2 * context_parallel = 8: ...
    """
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, int):
        raise PlanError(f"context_parallel must be an int >= 1, got {context_parallel!r}")
    c = context_parallel
    if c < 1 or ranks % c:
        raise PlanError(
            f"context_parallel={c} must be >= 1 and divide the {ranks} ranks left by tensor "
            "parallelism"
        )
    if layout not in CP_LAYOUTS:
        raise PlanError(f"cp_layout must be one of {', '.join(CP_LAYOUTS)}, got {layout!r}")
    pieces = 2 * c if layout == "zigzag" else c
    if c > 1 and seq_len % pieces:
        what = "2 * context_parallel" if layout == "zigzag" else "context_parallel"
        raise PlanError(
            f"seq_len={seq_len} is not divisible by {what} = {pieces}: the {layout} layout cuts "
            f"each sequence into {pieces} equal chunks; choose a seq_len that divides"
        )
    return c


class _AttentionCalls(TorchFunctionMode):
    """Records the elements of ``key`` and ``value`` of every scaled-dot-product attention."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: list[int] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            key = kwargs.get("key", args[1] if len(args) > 1 else None)
            value = kwargs.get("value", args[2] if len(args) > 2 else None)
            if isinstance(key, Tensor) and isinstance(value, Tensor):
                self.kv.append(key.numel() + value.numel())
        return func(*args, **kwargs)


def attention_kv_elements(
    model: nn.Module, batch_size: int, seq_len: int, batch: BatchBuilder | None
) -> list[int]:
    """The elements of K and V of each attention call in one forward, on fake tensors.

    Examples:
        >>> from fsdp_guide.parallel import ParallelConfig, ParallelTransformer
        >>> model = ParallelTransformer(ParallelConfig(n_layers=2, dim=32, seq_len=16))
        >>> attention_kv_elements(model, 2, 8, None)  # 2 x 8 tokens x 32 features, K and V
        [1024, 1024]
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_guide.memory._trace import _default_batch, _make_batch, _meta_copy, _to_fake

    traced = _meta_copy(model)
    make_batch = batch or _default_batch(traced)
    recorder = _AttentionCalls()
    with FakeTensorMode(allow_non_fake_inputs=True):
        _to_fake(traced)
        inputs, _ = _make_batch(make_batch, batch_size, seq_len)
        with torch.no_grad(), recorder:
            if isinstance(inputs, dict):
                traced(**inputs)
            elif isinstance(inputs, tuple):
                traced(*inputs)
            else:
                traced(inputs)
    return recorder.kv


def ring_payload(kv_elements: list[int], context_parallel: int) -> dict[str, int]:
    """Elements each rank sends and receives per training step over its ring.

    Examples:
        >>> ring_payload([1024, 1024], 4)  # 2 layers x 3 hops x (fwd K/V, bwd K/V, bwd grads)
        {'send': 18432, 'recv': 18432}
    """
    if context_parallel == 1:
        return {}
    elements = 3 * (context_parallel - 1) * sum(kv_elements)
    return {"send": elements, "recv": elements}


def cut_sequence(request: PlanRequest, rank: RankModel) -> RankModel:
    """Each rank computes ``seq_len / context_parallel`` tokens of every sample."""
    c = request.context_parallel
    return rank if c == 1 else replace(rank, seq_len=request.seq_len // c)


def ring(request: PlanRequest, rank: RankModel) -> RankModel:
    """The ring's sends and receives, from the K/V of the rank's model on its tokens."""
    c = request.context_parallel
    if c == 1:
        return rank
    try:
        kv = attention_kv_elements(rank.model, request.batch_size, rank.seq_len, request.batch)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise PlanError(f"cannot trace {type(request.model).__name__}'s attention: {exc}") from exc
    if not kv:
        raise PlanError(
            f"{type(request.model).__name__} calls no scaled_dot_product_attention: context "
            "parallelism is planned as ring attention in its place"
        )
    return rank.adding(ring_payload(kv, c), c)
