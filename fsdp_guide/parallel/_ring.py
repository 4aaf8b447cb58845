"""Ring attention: exact attention over a sequence cut into ``c`` chunks, one per rank (private).

Each rank keeps the queries of its tokens and, in turn, sees every rank's keys and values:
at step ``i`` it holds the K/V block of rank ``rank - i`` (mod ``c``), computes attention of
its queries against it, and passes the block on to ``rank + 1`` while it computes (a send to
the next rank, a receive from the previous one: ``torch.distributed`` point-to-point ops).
Partial results are merged with the online softmax: each block gives an output and the
log-sum-exp of its scores, and two partial outputs combine as their softmax weights say, so
the merged output is the exact attention over the whole sequence.

Backward runs the ring again: the K/V blocks go round once more, and the gradient of each
block (its ``dK``, ``dV``) travels with it, each rank adding what its queries contribute,
until it reaches the block's owner. Each rank sends ``c - 1`` K/V blocks in forward, and
``c - 1`` K/V blocks and ``c - 1`` gradient blocks in backward.

**Causal masking.** A query sees only the keys at or before its position. Cut the sequence
in ``c`` consecutive chunks (``"naive"``) and rank 0 needs only its own block while rank
``c - 1`` needs all ``c``: the ranks wait for the slowest. The ``"zigzag"`` (head-tail) cut
gives rank ``r`` chunks ``r`` and ``2c - 1 - r`` of ``2c``: every rank then does the same work
at every step (half a block, after the first), which is the load balancing torch's
``context_parallel`` applies to causal attention.

Only what a query sees is computed: a block none of whose keys a query chunk sees is skipped,
and the K/V of a block only partly seen are cut to the chunks that are.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fsdp_guide.parallel._ring_layout import (
    LAYOUTS,
    BlockWork,
    Layout,
    block_work,
    chunk_ids,
    share_of,
)
from fsdp_guide.parallel._ring_steps import record

# Point-to-point tags: a K/V block and a gradient block can be in flight between the same
# two ranks at once; the tags keep them apart.
_KV_TAG, _GRAD_TAG = 0, 1


# --- one block of attention, forward and backward -----------------------------------------


def _rows(x: Tensor, ids: tuple[int, ...], chunks: int) -> Tensor:
    """The chunks ``ids`` of ``x``'s sequence (dimension 2), a view when they are adjacent."""
    size = x.shape[2] // chunks
    if ids == tuple(range(ids[0], ids[-1] + 1)):
        return x.narrow(2, ids[0] * size, len(ids) * size)
    return torch.cat([x.narrow(2, i * size, size) for i in ids], dim=2)


def _positions(ids: tuple[int, ...], size: int) -> Tensor:
    return torch.cat([torch.arange(i * size, (i + 1) * size) for i in ids])


def _mask(rank: int, source: int, ranks: int, layout: Layout, work: BlockWork, size: int) -> Tensor:
    """``True`` where a key comes after its query (global positions), for the pairs kept."""
    mine, theirs = chunk_ids(rank, ranks, layout), chunk_ids(source, ranks, layout)
    q = _positions(tuple(mine[i] for i in work.rows), size)
    k = _positions(tuple(theirs[j] for j in work.cols), size)
    return k[None, :] > q[:, None]


@dataclass(frozen=True)
class _Block:
    """One rank's view of one K/V block: what to compute and its causal mask."""

    work: BlockWork
    chunks: int
    mask: Tensor | None


def _plan_block(ring: _Ring, step: int, seq_local: int, causal: bool) -> _Block:
    source = (ring.rank - step) % ring.size
    work = block_work(ring.rank, source, ring.size, ring.layout, causal)
    chunks = len(chunk_ids(ring.rank, ring.size, ring.layout))
    mask = None
    if work.diagonal and not work.empty:
        mask = _mask(ring.rank, source, ring.size, ring.layout, work, seq_local // chunks)
    return _Block(work=work, chunks=chunks, mask=mask)


def _scores(q: Tensor, k: Tensor, block: _Block, scale: float) -> Tensor:
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale
    if block.mask is not None:
        scores = scores.masked_fill(block.mask.to(scores.device), float("-inf"))
    return scores


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, block: _Block, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention of the kept query rows against the kept keys: (output, log-sum-exp)."""
    w = block.work
    scores = _scores(_rows(q, w.rows, block.chunks), _rows(k, w.cols, block.chunks), block, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, _rows(v, w.cols, block.chunks).float()), lse


def _merge(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor, rows: slice) -> None:
    """Fold a block's partial result into the running output (online softmax), in place.

    Two softmaxes over disjoint keys combine as ``out = a * out + b * part`` with
    ``a = exp(lse - new)``, ``b = exp(part_lse - new)``, ``new = logaddexp(lse, part_lse)``.
    """
    new = torch.logaddexp(lse[..., rows], part_lse)
    old_weight = torch.exp(lse[..., rows] - new).nan_to_num(0.0).unsqueeze(-1)
    part_weight = torch.exp(part_lse - new).unsqueeze(-1)
    out[..., rows, :] = out[..., rows, :] * old_weight + part * part_weight
    lse[..., rows] = new


def _row_slice(rows: tuple[int, ...], chunks: int, seq_local: int) -> slice:
    size = seq_local // chunks
    return slice(rows[0] * size, (rows[-1] + 1) * size)


# --- the ring ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ring:
    """Who this rank sends to and receives from, in the group's ring."""

    group: Any
    rank: int
    size: int
    layout: Layout

    @property
    def next(self) -> int:
        import torch.distributed as dist

        return int(dist.get_global_rank(self.group, (self.rank + 1) % self.size))

    @property
    def prev(self) -> int:
        import torch.distributed as dist

        return int(dist.get_global_rank(self.group, (self.rank - 1) % self.size))

    def shift(self, tensor: Tensor, tag: int) -> tuple[Tensor, list[Any]]:
        """Start sending ``tensor`` to the next rank and receiving its like from the previous
        one; the received tensor is valid once the returned requests are waited on."""
        import torch.distributed as dist

        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ]
        return received, dist.batch_isend_irecv(ops)


def _ring_of(group: Any, layout: Layout) -> _Ring:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return _Ring(group=None, rank=0, size=1, layout=layout)
    group = group if group is not None else dist.group.WORLD
    return _Ring(
        group=group, rank=dist.get_rank(group), size=dist.get_world_size(group), layout=layout
    )


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    """Ring attention's forward and backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool, ring: _Ring) -> Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        seq = q.shape[2]
        # Laid out (batch, tokens, heads, head_dim), as flash attention returns it: the usual
        # transpose back to (batch, tokens, features) is then a view, not a copy.
        b, h, _, d = q.shape
        out = torch.zeros((b, seq, h, d), dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(ring.size):
            pending: list[Any] = []
            if step < ring.size - 1:  # pass the block on while computing with it
                incoming, pending = ring.shift(kv, _KV_TAG)
            block = _plan_block(ring, step, seq, causal)
            started = (time.perf_counter(), time.thread_time())
            if not block.work.empty:
                part, part_lse = _block_forward(q, kv[0], kv[1], block, scale)
                _merge(out, lse, part, part_lse, _row_slice(block.work.rows, block.chunks, seq))
            record("forward", step, started, share_of(block.work, block.chunks))
            if pending:
                _wait(pending)
                kv = incoming
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.causal, ctx.ring, ctx.scale = causal, ring, scale
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, scale = ctx.ring, ctx.causal, ctx.scale
        seq = q.shape[2]
        grad_out = grad_out.float()
        delta = (grad_out * out.float()).sum(-1)  # rowsum(dO * O), softmax's backward term
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        own = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        carried: Tensor | None = None  # the gradient of the block held, from earlier ranks
        grad_pending: list[Any] = []
        sent: list[Tensor] = []  # kept alive until their sends complete
        for step in range(ring.size):
            kv_pending: list[Any] = []
            if step < ring.size - 1:
                incoming, kv_pending = ring.shift(kv, _KV_TAG)
            block = _plan_block(ring, step, seq, causal)
            part = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            started = (time.perf_counter(), time.thread_time())
            if not block.work.empty:
                _block_backward(q, kv, grad_out, lse, delta, block, scale, dq, part)
            record("backward", step, started, share_of(block.work, block.chunks))
            if step == 0:
                own = part  # the rank's own block: its gradient stays here
            else:
                if grad_pending:
                    _wait(grad_pending)
                total = part if carried is None else part + carried
                # On to the next rank: it holds this block next (or owns it, after the last step).
                carried, grad_pending = ring.shift(total, _GRAD_TAG)
                sent.append(total)
            if kv_pending:
                _wait(kv_pending)
                kv = incoming
        if grad_pending:
            _wait(grad_pending)
            assert carried is not None
            own = own + carried
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None


def _block_backward(
    q: Tensor,
    kv: Tensor,
    grad_out: Tensor,
    lse: Tensor,
    delta: Tensor,
    block: _Block,
    scale: float,
    dq: Tensor,
    dkv: Tensor,
) -> None:
    """Add one block's ``dQ`` (into ``dq``) and ``dK``, ``dV`` (into ``dkv``), in place.

    The probabilities are rebuilt from the merged log-sum-exp, so each block's share of the
    softmax is exact: ``dS = P * (dO Vᵀ - rowsum(dO * O))``.
    """
    w, chunks = block.work, block.chunks
    rows = _row_slice(w.rows, chunks, q.shape[2])
    q_rows = _rows(q, w.rows, chunks)
    k_cols, v_cols = _rows(kv[0], w.cols, chunks), _rows(kv[1], w.cols, chunks)
    probs = torch.exp(_scores(q_rows, k_cols, block, scale) - lse[..., rows].unsqueeze(-1))
    d_out = grad_out[..., rows, :]
    d_probs = torch.matmul(d_out, v_cols.float().transpose(-2, -1))
    d_scores = probs * (d_probs - delta[..., rows].unsqueeze(-1)) * scale
    dq[..., rows, :] += torch.matmul(d_scores, k_cols.float())
    dk = torch.matmul(d_scores.transpose(-2, -1), q_rows.float())
    dv = torch.matmul(probs.transpose(-2, -1), d_out)
    size = kv.shape[3] // chunks
    for position, j in enumerate(w.cols):  # the key chunks used, back into the block
        dkv[0, ..., j * size : (j + 1) * size, :] += dk[
            ..., position * size : (position + 1) * size, :
        ]
        dkv[1, ..., j * size : (j + 1) * size, :] += dv[
            ..., position * size : (position + 1) * size, :
        ]


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    layout: Layout = "naive",
    group: Any = None,
) -> Tensor:
    """Attention of this rank's queries over the whole sequence, its K/V passed round a ring.

    Each rank passes its share of the sequence, cut by :func:`shard_sequence` with the same
    ``layout``; the result is this rank's share of ``softmax(q kᵀ / √d) v`` over the whole
    sequence (with a causal mask on global positions when ``causal``), and so are the
    gradients of ``q``, ``k`` and ``v``. Autograd saves only this rank's ``q``, ``k``, ``v``,
    output and log-sum-exp: activations scale with ``seq_len / c``.

    Args:
        q: Queries, ``(batch, heads, tokens of this rank, head_dim)``.
        k: Keys, the same shape.
        v: Values, the same shape.
        causal: Mask the keys that come after each query.
        layout: How the sequence was cut: ``"naive"`` (consecutive chunks) or ``"zigzag"``
            (chunks ``r`` and ``2c - 1 - r`` of ``2c``).
        group: The ranks of the ring (the default group if ``None``); without a process
            group, one rank holds the whole sequence.

    Returns:
        This rank's output, ``q``'s shape and dtype.

    Raises:
        ValueError: An unknown layout, or ``q``, ``k``, ``v`` of different shapes.

    Examples:
        With one rank the ring is plain attention:

        >>> q, k, v = torch.randn(3, 1, 2, 8, 4).unbind(0)
        >>> expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> torch.allclose(ring_attention(q, k, v, causal=True), expected, atol=1e-6)
        True
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not q.shape == k.shape == v.shape:
        raise ValueError(
            f"q, k and v must have one shape (batch, heads, tokens, head_dim); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (repeat grouped K/V heads first)"
        )
    ring = _ring_of(group, layout)
    if q.shape[2] % len(chunk_ids(0, ring.size, layout)):
        raise ValueError(
            f"{q.shape[2]} local tokens do not cut into the {layout!r} layout's "
            f"{len(chunk_ids(0, ring.size, layout))} chunks per rank"
        )
    result: Tensor = _RingAttention.apply(q, k, v, causal, ring)  # type: ignore[no-untyped-call]
    return result


def ring_elements(
    batch_size: int, heads: int, tokens: int, head_dim: int, ranks: int
) -> dict[str, int]:
    """Elements each rank sends (and receives) per training step in one ring attention.

    Forward passes ``ranks - 1`` K/V blocks on; backward passes them again and as many
    gradient blocks, each block ``2 · batch_size · heads · tokens · head_dim`` elements (its
    K and V, ``tokens`` of this rank's).

    Examples:
        >>> ring_elements(2, 4, 8, 16, ranks=4)
        {'send': 18432, 'recv': 18432}
    """
    block = 2 * batch_size * heads * tokens * head_dim
    hops = 3 * (ranks - 1)
    return {"send": hops * block, "recv": hops * block} if ranks > 1 else {}
